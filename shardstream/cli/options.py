"""Arguments shared by commands: storage flags, human-readable sizes, and a parser that suggests
the flag or command a typo meant."""

from __future__ import annotations

import argparse
import difflib
import re
import sys

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "M": 1000**2,
    "MB": 1000**2,
    "G": 1000**3,
    "GB": 1000**3,
    "T": 1000**4,
    "TB": 1000**4,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
    "TIB": 1024**4,
}


def parse_size(text: str) -> int:
    """'256MB' -> 256000000, '1GiB' -> 1073741824, '4096' -> 4096."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4096, 64MB, 1.5GB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


DEADLINE_HELP = "give up on a storage request after this long across its retries (default 60)"


def writer_deadline_help(reads: str) -> str:
    """``--deadline``'s help for a command that also writes: ``reads``, what it bounds; uploads are
    retried by botocore (``StorageConfig``'s tries and timeouts), which the deadline does not bound."""
    from shardstream.storage.config import DEFAULT_STORAGE

    return (
        f"give up on {reads} after this long across its retries (default {DEFAULT_STORAGE.deadline:g}); "
        f"each upload is retried by botocore, up to {DEFAULT_STORAGE.upload_attempts} tries"
    )


def add_storage_arguments(parser: argparse.ArgumentParser, *, deadline_help: str = DEADLINE_HELP) -> None:
    """The storage flags; ``deadline_help``: what ``--deadline`` bounds, where a command differs."""
    group = parser.add_argument_group("storage (S3 and other fsspec URLs)")
    group.add_argument("--endpoint-url", help="S3-compatible endpoint (default: AWS_ENDPOINT_URL or AWS)")
    group.add_argument("--profile", help="AWS profile from ~/.aws/config")
    group.add_argument(
        "--allow-root",
        action="append",
        default=[],
        metavar="URL",
        help="a location outside the dataset's root that its manifest may list shards in (repeatable)",
    )
    group.add_argument("--deadline", type=float, default=None, metavar="SECONDS", help=deadline_help)


def storage_options_from(args: argparse.Namespace) -> dict:
    from shardstream.storage.fs import make_storage_options  # (the storage layer: imported by a command that runs, not by the parser)

    return make_storage_options(endpoint_url=args.endpoint_url, profile=args.profile)


def storage_config_from(args: argparse.Namespace):
    """The StorageConfig the flags ask for (defaults where a command has no such flag)."""
    from shardstream.storage.config import DEFAULT_STORAGE, StorageConfig

    roots = tuple(getattr(args, "allow_root", None) or ())
    deadline = getattr(args, "deadline", None)
    if not roots and deadline is None:
        return DEFAULT_STORAGE
    return StorageConfig(allow_roots=roots, **({"deadline": deadline} if deadline is not None else {}))


def load_dataset_manifest(url: str, storage_options: dict, config):
    """``load_manifest``, where a missing manifest over an interrupted pack's shards says so ("run
    pack again to complete it"), not that the shards want ``shardstream index``: indexed, part of
    the samples would train as if they were the whole dataset."""
    from shardstream.errors import ManifestError, StorageNotFound
    from shardstream.format.manifest import load_manifest, manifest_url
    from shardstream.write.writer import refuse_interrupted_pack

    try:
        return load_manifest(url, storage_options, config=config)
    except ManifestError as exc:
        if not isinstance(exc.__cause__, StorageNotFound):
            raise
        target = manifest_url(url)
        refuse_interrupted_pack(target.rsplit("/", 1)[0] if "/" in target else ".", storage_options, config=config)
        raise


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


class SuggestingParser(argparse.ArgumentParser):
    """An ArgumentParser whose "unrecognized arguments" and "invalid choice" errors name the
    closest real flag or command (``--overwite`` -> ``did you mean --overwrite?``). Its flags are
    those of the actions ``add_argument`` returned (on the parser or one of its groups), its
    commands the ``choices`` of the action ``add_subparsers`` returned: argparse's public API."""

    def __init__(self, *args, **kwargs):
        self.flags: list[str] = []  # before argparse's own __init__, which adds -h/--help
        self.commands: dict[str, SuggestingParser] = {}
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        self.flags += action.option_strings
        return action

    def _recording(self, group):
        add = group.add_argument

        def add_argument(*args, **kwargs):
            action = add(*args, **kwargs)
            self.flags += action.option_strings
            return action

        group.add_argument = add_argument
        return group

    def add_argument_group(self, *args, **kwargs):
        return self._recording(super().add_argument_group(*args, **kwargs))

    def add_mutually_exclusive_group(self, **kwargs):
        return self._recording(super().add_mutually_exclusive_group(**kwargs))

    def add_subparsers(self, **kwargs):
        action = super().add_subparsers(**kwargs)
        self.commands = action.choices  # command -> its parser, filled by add_parser
        return action

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def _options_in_use(self) -> list[str]:
        """This parser's flags and those of the command named in the arguments."""
        options = list(self.flags)
        for token in getattr(self, "_argv", []):
            command = self.commands.get(token)
            if command is not None:
                options += getattr(command, "flags", [])
                break
        return options

    def error(self, message: str):
        hints = []
        if message.startswith("unrecognized arguments:"):
            options = self._options_in_use()
            for token in message.split(":", 1)[1].split():
                if token.startswith("-"):
                    close = difflib.get_close_matches(token.split("=", 1)[0], options, n=1, cutoff=0.6)
                    if close:
                        hints.append(f"{token}: did you mean {close[0]}?")
        elif "invalid choice:" in message:
            m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
            if m:
                choices = re.findall(r"'([^']*)'", m.group(2)) or [c.strip() for c in m.group(2).split(",")]
                close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
                if close:
                    hints.append(f"did you mean {close[0]!r}?")
        super().error(message + ("\n" + "\n".join(hints) if hints else ""))

"""Entry point of the ``shardstream`` command: parse, dispatch, turn errors into one clear line.

Only shardstream's own errors (``errors.ShardstreamError``, each naming what is wrong and what to
do) become one line; anything else is a bug and shows its traceback.

Each command is a module with ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args)``;
``run`` returns the exit code. Tests call ``main([...])`` in-process.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from shardstream.errors import ShardstreamError

from . import bench, index, ls, merge, pack, show, verify
from .options import SuggestingParser

COMMANDS = [pack, ls, show, verify, index, merge, bench]

EPILOG = """examples:
  shardstream pack ./images ./shards --label-from-dir --max-count 1000
  shardstream pack data.jsonl s3://bucket/train --max-size 256MB --shuffle --seed 1
  shardstream ls ./shards
  shardstream show ./shards -n 3
  shardstream verify s3://bucket/train --endpoint-url http://127.0.0.1:9000
  shardstream index 'wds/train-{000000..000099}.tar' ./wds
  shardstream merge ./all ./all/day-01 ./all/day-02
  shardstream bench ./shards --workers 2 --seconds 20
Run 'shardstream COMMAND --help' for a command's options and examples.
"""


def build_parser() -> argparse.ArgumentParser:
    from shardstream import __version__

    parser = SuggestingParser(
        prog="shardstream",
        description="Pack and stream WebDataset tar shards for PyTorch.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shardstream {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        p = sub.add_parser(
            module.NAME,
            help=module.HELP,
            description=module.HELP,
            epilog=getattr(module, "EPILOG", None),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(f"shardstream {args.command}: interrupted", file=sys.stderr)
        return 130
    except ShardstreamError as exc:
        if args.debug:
            raise
        print(f"shardstream {args.command}: error: {exc}", file=sys.stderr)
        return 1


def entry() -> None:
    """The console script. A reader that stops early (``shardstream ls DATASET | head -3``)
    closes the pipe: that ends the command quietly, with 141 (128 + SIGPIPE) as a shell reports
    a command killed by SIGPIPE, whatever the command."""
    try:
        code = main()
        sys.stdout.flush()  # a broken pipe shows here, not at interpreter exit where it cannot be caught
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at devnull so that flush cannot fail too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        sys.exit(141)
    sys.exit(code)

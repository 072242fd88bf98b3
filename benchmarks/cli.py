"""The command line: one subcommand per workload, the same options for each, and ``report``.

    OMP_NUM_THREADS=1 python -m benchmarks small --peer shardstream,litdata --venv litdata=/tmp/venv-litdata \\
        --workers 0,2 --repeats 3 --out figures.jsonl
    python -m benchmarks report figures.jsonl            # refreshes BENCHMARKS.md's current figures

Every measurement is a fresh process of its peer's interpreter (``--venv PEER=PATH``, else this
one if the peer imports here, else the peer is said to be not installed and left out), one pass,
timed from the loader's construction. Repeats are interleaved (A B A B); each measurement is one
JSON line on stdout (and appended to ``--out``), and the medians are printed to stderr at the end.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

WORKLOADS = {
    "small": "small",
    "image": "image",
    "large": "large",
    "s3": "s3",
    "tables": "tables",
    "tokens": "tokens",
    "pack": "pack",
    "first-batch": "first_batch",
    "resume": "resume",
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _venvs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        peer, sep, path = item.partition("=")
        if not sep or not path:
            raise SystemExit(f"--venv {item}: give PEER=PATH (a venv's folder)")
        out[peer] = os.path.abspath(path)
    return out


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    subs = top.add_subparsers(dest="command", required=True)
    for name, module_name in WORKLOADS.items():
        module = importlib.import_module(f"benchmarks.{module_name}")
        doc = module.__doc__ or ""
        p = subs.add_parser(name, help=doc.split("\n")[0], description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--peer", default="shardstream", help=f"comma-separated, of: {', '.join(module.PEERS)}; 'all' for every one")
        p.add_argument("--venv", action="append", default=[], metavar="PEER=PATH", help="run PEER with PATH/bin/python (repeatable)")
        p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (A B A B ...); the report gives medians")
        p.add_argument(
            "--workers", type=_ints, default=[0, 2], help="DataLoader workers (pack: pack's own), comma-separated (default 0,2; pack 1,2; resume 2)"
        )
        p.add_argument("--workdir", default="/dev/shm/ssbench", help="where the data is written (kept for the next run)")
        p.add_argument("--out", help="append the JSON lines to this file too")
        p.add_argument(
            "--runtime", default=None, help="passed to make_loader as workers=RUNTIME (e.g. threads), where this shardstream's make_loader has it"
        )
        module.add_arguments(p)
        p.set_defaults(module=module, module_name=module_name, workload=name)
    rep = subs.add_parser("report", help="write BENCHMARKS.md's current-figures table from JSON lines")
    rep.add_argument("files", nargs="+", help="JSON lines written by the workloads")
    rep.add_argument("--markdown", default=None, help="the file to refresh (default: the repository's BENCHMARKS.md)")
    rep.add_argument("--print", action="store_true", help="print the table instead of writing it")
    return top


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.command == "report":
        from benchmarks import report

        report.main(args)
        return
    from benchmarks.harness import Runner, interleave, summary

    module = args.module
    peers = list(module.PEERS) if args.peer == "all" else [p for p in args.peer.split(",") if p]
    unknown = [p for p in peers if p not in module.PEERS]
    if unknown:
        raise SystemExit(f"{args.workload}: no peer {', '.join(unknown)} (peers: {', '.join(module.PEERS)})")
    runner = Runner(_venvs(args.venv))
    os.makedirs(args.workdir, exist_ok=True)
    out = open(args.out, "a") if args.out else None

    def emit(rec: dict) -> None:
        line = json.dumps(rec)
        print(line, flush=True)
        if out is not None:
            out.write(line + "\n")
            out.flush()

    try:
        with getattr(module, "context", _no_context)(args, runner) as extra:
            installed = []
            from benchmarks.harness import NotInstalled

            for peer in peers:
                try:
                    runner.python(peer)
                    installed.append(peer)
                except NotInstalled as e:
                    print(f"skipped: {e}", file=sys.stderr)
            configs = module.prepare(args, runner, installed, **extra)
            records = interleave(
                args.workload,
                args.module_name,
                installed,
                configs,
                args.repeats,
                runner,
                module.UNIT,
                emit,
                skip=getattr(module, "skip", lambda peer, config: False),
                rate_of=getattr(module, "RATE", "rate"),
            )
    finally:
        if out is not None:
            out.close()
    if records:
        print(summary(records), file=sys.stderr)


class _no_context:
    def __init__(self, args, runner):
        pass

    def __enter__(self):
        return {}

    def __exit__(self, *exc):
        return False

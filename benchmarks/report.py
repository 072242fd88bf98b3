"""``python -m benchmarks report FILE.jsonl ...``: the medians of the JSON lines as one table,
written into BENCHMARKS.md between the marker comments (the rest of the file is left alone).

One row per (workload, config, peer): the median rate and its range over the repeats, the
median CPU per item, the ratio to shardstream's median in the same file (the same config), the
load average over the runs, the versions, and the command with its git commit and date.
"""

from __future__ import annotations

import json
import os
import statistics

from benchmarks.harness import REPO, config_text, number

START = "<!-- current-figures: start (python -m benchmarks report) -->"
END = "<!-- current-figures: end -->"


def load(paths: list[str]) -> list[dict]:
    records = []
    for path in paths:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{path}:{number}:{e.colno}: not a JSON line ({e.msg})") from None
                if not isinstance(rec, dict) or not {"workload", "peer", "config", "rate", "unit"} <= rec.keys():
                    raise SystemExit(f"{path}:{number}:1: not a benchmark record (workload, peer, config, rate, unit)")
                records.append(rec)
    return records


_num = number


def table(records: list[dict]) -> str:
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["workload"], config_text(r["config"]), r["peer"]), []).append(r)
    medians = {key: statistics.median(r["rate"] for r in rs) for key, rs in groups.items()}
    lines = [
        "| workload | config | peer | median | range (runs) | CPU per item | shardstream vs peer | load | versions | command (commit, date) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (workload, config, peer), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "shardstream", kv[0][2])):
        rates = [r["rate"] for r in rs]
        unit = rs[0]["unit"]
        cpu = [r["cpu_us_per_item"] for r in rs if r.get("cpu_us_per_item") is not None]
        ours = medians.get((workload, config, "shardstream"))
        ratio = (
            "-" if peer == "shardstream" or not ours or not medians[(workload, config, peer)] else f"{ours / medians[(workload, config, peer)]:.2f}x"
        )
        if unit == "s" and ratio != "-":  # seconds: less is better, so the peer's over ours
            ratio = f"{medians[(workload, config, peer)] / ours:.2f}x"
        loads = [r["load_average"][0] for r in rs if r.get("load_average")]
        versions = ", ".join(f"{k} {v}" for k, v in sorted(rs[0].get("versions", {}).items()) if v)
        when = rs[-1].get("time", "")[:10]
        median = f"{_num(medians[(workload, config, peer)])} {unit}"
        spread = f"{_num(min(rates))}-{_num(max(rates))} ({len(rs)})"
        per_item = f"{_num(statistics.median(cpu))} us" if cpu else "-"
        load = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"
        command = f"`{rs[0].get('command', '')}` ({rs[0].get('git_commit', '')}, {when})"
        lines.append(f"| {workload} | {config} | {peer} | {median} | {spread} | {per_item} | {ratio} | {load} | {versions} | {command} |")
    return "\n".join(lines)


def refresh(markdown: str, text: str) -> str:
    """``markdown`` with the text between the markers replaced (the markers put under "## Current
    figures", or at the end, where the file has none yet)."""
    block = f"{START}\n\n{text}\n\n{END}"
    if START in markdown and END in markdown:
        before, rest = markdown.split(START, 1)
        return before + block + rest.split(END, 1)[1]
    heading = "## Current figures\n"
    if heading in markdown:
        before, after = markdown.split(heading, 1)
        return f"{before}{heading}\n{block}\n{after}"
    return markdown.rstrip("\n") + f"\n\n{heading}\n{block}\n"


def main(args) -> None:
    text = table(load(args.files))
    if args.print:
        print(text)
        return
    path = args.markdown or os.path.join(REPO, "BENCHMARKS.md")
    old = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    with open(path, "w") as f:
        f.write(refresh(old, text))
    print(f"{path}: current figures from {len(args.files)} file(s)")

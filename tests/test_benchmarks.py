"""``python -m benchmarks``: every workload's subcommand measures a tiny run with shardstream and
writes JSON lines of one shape; peers run interleaved (A B A B); a peer not installed is said
and left out; ``report`` writes the current-figures table between its markers, and again in place."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import report  # noqa: E402

TINY = {
    "small": ["--samples", "300", "--per-shard", "100"],
    "image": ["--images", "12", "--per-shard", "6", "--batch", "4"],
    "large": ["--samples", "4", "--mb", "0.25", "--batch", "2"],
    "s3": ["--samples", "4", "--mb", "0.25", "--per-shard", "2"],
    "tables": ["--rows", "3000", "--files", "2", "--group", "1000", "--batch", "500"],
    "tokens": ["--tokens", "20000", "--seq-len", "64", "--batch", "4"],
    "pack": ["--samples", "40", "--workers", "1"],
    "first-batch": ["--samples", "4", "--mb", "0.25", "--per-shard", "2"],
    "resume": ["--samples", "600", "--per-shard", "100", "--at", "0.5", "--workers", "0"],
}
UNITS = {"small": "samples/s", "image": "images/s", "large": "MB/s", "s3": "MB/s", "tables": "rows/s", "tokens": "tokens/s", "pack": "samples/s"}
KEYS = {"workload", "peer", "config", "repeat", "rate", "unit", "seconds", "items", "versions", "load_average", "command", "git_commit", "time"}


def bench(tmp_path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", *args, "--workdir", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=240,
    )
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("workload", list(TINY))
def test_each_workload_measures_shardstream_as_one_json_line(tmp_path, workload):
    out = tmp_path / "figures.jsonl"
    extra = [] if "--workers" in TINY[workload] else ["--workers", "0"]
    done = bench(tmp_path, workload, "--repeats", "1", "--out", str(out), *extra, *TINY[workload])
    records = lines(out)
    assert [json.loads(line) for line in done.stdout.splitlines()] == records  # stdout and --out alike
    assert len(records) == 1
    rec = records[0]
    assert KEYS <= rec.keys()
    assert rec["workload"] == workload and rec["peer"] == "shardstream" and rec["repeat"] == 0
    assert rec["unit"] == UNITS.get(workload, "s") and rec["rate"] > 0 and rec["seconds"] > 0 and rec["items"] > 0
    assert rec["versions"]["shardstream"] and rec["versions"]["torch"] and rec["versions"]["python"]
    assert rec["command"].startswith("python") and f"-m benchmarks {workload}" in rec["command"]
    assert len(rec["load_average"]) == 3 and rec["git_commit"]
    assert not any(k.startswith("_") for k in rec["config"])  # data paths stay out of the record
    if workload in ("small", "tokens", "tables"):
        n = {"small": 300 // 64 * 64, "tokens": None, "tables": 3000}[workload]
        assert n is None or rec["items"] == n
    if workload == "pack":
        assert rec["items"] == 40 and rec["config"]["workers"] == 1


def test_peers_run_interleaved_and_a_missing_one_is_said(tmp_path):
    out = tmp_path / "figures.jsonl"
    nowhere = f"litdata={tmp_path / 'nowhere'}"
    done = bench(
        tmp_path,
        "small",
        "--peer",
        "shardstream,torch,litdata",
        "--venv",
        nowhere,
        "--repeats",
        "2",
        "--workers",
        "0",
        "--out",
        str(out),
        *TINY["small"],
    )
    assert f"skipped: litdata: {tmp_path / 'nowhere'}/bin/python does not exist" in done.stderr
    records = lines(out)
    assert [(r["peer"], r["repeat"]) for r in records] == [("shardstream", 0), ("torch", 0), ("shardstream", 1), ("torch", 1)]
    assert records[1]["items"] == 300 and records[0]["items"] == 256  # torch keeps the last partial batch; shardstream drops it
    assert "median" in done.stderr  # the summary at the end

    bad = bench(tmp_path, "small", "--peer", "grain", check=False)
    assert bad.returncode != 0 and "small: no peer grain" in bad.stderr


def test_runtime_goes_to_make_loader_only_where_it_has_the_keyword(tmp_path):
    from shardstream import make_loader

    done = bench(tmp_path, "first-batch", "--runtime", "threads", "--repeats", "1", "--workers", "0", *TINY["first-batch"], check=False)
    if "workers" in inspect.signature(make_loader).parameters:
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout.splitlines()[-1])["config"]["runtime"] == "threads"
    else:
        assert done.returncode != 0 and "--runtime: this shardstream's make_loader has no workers= option" in done.stderr


def test_report_writes_the_table_between_its_markers_and_refreshes_it(tmp_path):
    def rec(peer, rate, repeat, workers=0, load=1.0):
        config = {"workers": workers, "samples": 100}
        versions = {"python": "3.11.7", "torch": "2.13.0"}
        return {"workload": "small", "peer": peer, "config": config, "repeat": repeat, "rate": rate, "unit": "samples/s", "seconds": 1.0,
                "items": 100,
                "cpu_us_per_item": 10.0, "versions": versions, "load_average": [load, 1, 1], "command": "python -m benchmarks small",
                "git_commit": "abc1234", "time": "2026-12-02T01:00:00Z"}  # fmt: skip

    jsonl = tmp_path / "f.jsonl"
    rows = [
        rec("shardstream", 300, 0),
        rec("webdataset", 100, 0, load=2.5),
        rec("shardstream", 500, 1),
        rec("webdataset", 200, 1),
        rec("shardstream", 400, 2),
    ]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\n## Current figures\n\nkept text\n\n# History\n\nold\n")
    env = {**os.environ, "PYTHONPATH": REPO}
    for _ in range(2):  # written, then refreshed in place
        subprocess.run(
            [sys.executable, "-m", "benchmarks", "report", str(jsonl), "--markdown", str(md)], check=True, env=env, cwd=tmp_path, timeout=120
        )
        text = md.read_text()
        assert text.count(report.START) == 1 and text.count(report.END) == 1
        assert "kept text" in text and text.endswith("# History\n\nold\n")
        table = text.split(report.START)[1].split(report.END)[0]
        ours = next(line for line in table.splitlines() if "| shardstream |" in line)
        theirs = next(line for line in table.splitlines() if "| webdataset |" in line)
        assert "| 400 samples/s | 300-500 (3) |" in ours  # the median of three, its range
        assert "| 150 samples/s | 100-200 (2) |" in theirs and "| 2.67x |" in theirs and "| 1.0-2.5 |" in theirs  # 400 / 150
        assert text.index(report.START) < text.index("kept text")  # under "## Current figures"
    jsonl.write_text('{"workload": "small"}\nnot json\n')
    bad = subprocess.run(
        [sys.executable, "-m", "benchmarks", "report", str(jsonl), "--print"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert bad.returncode != 0 and f"{jsonl}:1:1: not a benchmark record" in bad.stderr


def test_small_reads_shards_webdataset_wrote_and_indexed_in_place(tmp_path):
    out = tmp_path / "figures.jsonl"
    bench(
        tmp_path,
        "small",
        "--writer",
        "webdataset",
        "--peer",
        "shardstream,webdataset",
        "--repeats",
        "1",
        "--workers",
        "0",
        "--out",
        str(out),
        *TINY["small"],
    )
    tars = tmp_path / "work" / "small-webdataset-300" / "tars"
    assert sorted(p.name for p in tars.glob("*.tar")) == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    assert (tars / "index.json").exists()  # `shardstream index` wrote the manifest beside them
    records = lines(out)
    assert [(r["peer"], r["config"]["writer"], r["items"]) for r in records] == [
        ("shardstream", "webdataset", 256),
        ("webdataset", "webdataset", 300),
    ]
    assert records[1]["versions"]["webdataset"]

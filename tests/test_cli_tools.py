"""shardstream ls | show | verify | index | bench, in-process through main([...]), on local disk
and on the moto S3 server."""

from __future__ import annotations

import json
import shlex
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import webdataset as wds
from conftest import make_samples, scaled, write_dataset, write_image_folder
from PIL import Image

from shardstream import ShardStream, ShardWriter, World
from shardstream.cli.main import build_parser, main
from shardstream.format.offsets import encode_offsets
from shardstream.write.pack import pack


@pytest.fixture
def packed(tmp_path):
    src = tmp_path / "src"
    write_image_folder(src, classes=3, per_class=4)
    pack(str(src), str(tmp_path / "ds"), label_from_dir=True, max_count=5)
    return tmp_path / "ds"


def test_every_command_has_help_with_examples(capsys):
    parser = build_parser()
    assert "examples:" in parser.format_help()
    for command in ("pack", "ls", "show", "verify", "index", "bench"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
        assert "examples:" in capsys.readouterr().out


def test_ls_text_and_json(packed, capsys):
    assert main(["ls", str(packed)]) == 0
    out = capsys.readouterr().out
    assert "3 shards, 12 samples" in out and "png (12)" in out and "class_1  4 samples" in out
    assert main(["ls", str(packed), "--json", "--shards"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["samples"] == 12 and doc["label_counts"] == {"class_0": 4, "class_1": 4, "class_2": 4}
    assert [s["samples"] for s in doc["shard_list"]] == [5, 5, 2]


def test_ls_on_s3(s3, capsys):
    bucket, options, _ = s3
    with ShardWriter(f"s3://{bucket}/d", storage_options=options) as w:
        for s in make_samples(9):
            w.write(s)
    assert main(["ls", f"s3://{bucket}/d", "--endpoint-url", options["endpoint_url"]]) == 0
    assert "1 shards, 9 samples" in capsys.readouterr().out


def test_show_first_samples_and_by_key(packed, tmp_path, capsys):
    assert main(["show", str(packed), "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("(") == 2 and "image PNG 16x16 RGB" in out and "int 0" in out
    assert main(["show", str(packed), "--key", "class_2/0003", "--extract", str(tmp_path / "x")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("class_2/0003")
    extracted = tmp_path / "x" / "class_2" / "0003.png"
    assert extracted.read_bytes() == (tmp_path / "src" / "class_2" / "0003.png").read_bytes()
    assert main(["show", str(packed), "--key", "nope/1"]) == 1
    assert "no sample with key 'nope/1'" in capsys.readouterr().err


def test_show_finds_long_keys_behind_pax_headers(tmp_path, capsys):
    key = "deep/" + "k" * 150
    samples = make_samples(30)
    samples[17]["__key__"] = key
    with ShardWriter(str(tmp_path / "d"), max_count=10) as w:
        for s in samples:
            w.write(s)
    assert main(["show", str(tmp_path / "d"), "--key", key]) == 0
    out = capsys.readouterr().out
    assert "text sample 17" in out and ".bin" in out and "bytes " in out


def corrupt(path, offset, value=b"\xff"):
    data = bytearray(path.read_bytes())
    data[offset : offset + len(value)] = value
    path.write_bytes(bytes(data))


def test_verify_reports_every_problem(tmp_path, capsys):
    samples = make_samples(40)
    samples[25]["png"] = b"not an image"
    with ShardWriter(str(tmp_path / "d"), max_count=10) as w:
        for s in samples:
            w.write(s)
    assert main(["verify", str(tmp_path / "d")]) == 0
    assert capsys.readouterr().out.startswith("OK: 4 shards, 40 samples")
    assert main(["verify", str(tmp_path / "d"), "--deep"]) == 1
    out = capsys.readouterr().out
    assert "shard-000002.tar [s000025]: cannot decode field 'png'" in out
    corrupt(tmp_path / "d" / "shard-000000.tar", 600)  # inside sample data: only the digest changes
    shard1 = tmp_path / "d" / "shard-000001.tar"
    shard1.write_bytes(shard1.read_bytes()[:3000])  # truncated
    (tmp_path / "d" / "shard-000003.tar").unlink()
    assert main(["verify", str(tmp_path / "d")]) == 1
    out = capsys.readouterr().out
    assert "shard-000000.tar: sha256 is" in out
    assert "shard-000001.tar: size is 3000 bytes" in out and "shard-000001.tar: unreadable after" in out
    assert "shard-000003.tar: missing" in out
    assert "4 problems" in out


def test_verify_on_s3_finds_a_count_that_lies(s3, capsys):
    bucket, options, client = s3
    with ShardWriter(f"s3://{bucket}/v", max_count=10, storage_options=options) as w:
        for s in make_samples(20):
            w.write(s)
    doc = json.loads(client.get_object(Bucket=bucket, Key="v/index.json")["Body"].read())
    doc["shards"]["samples"][1] = 9
    sidecar = client.get_object(Bucket=bucket, Key="v/shard-000001.tar.idx")["Body"].read()
    offsets = list(struct.unpack("<11Q", sidecar[16:]))
    client.put_object(Bucket=bucket, Key="v/shard-000001.tar.idx", Body=encode_offsets(offsets[:9] + offsets[-1:]))
    doc["total_samples"] = 19
    client.put_object(Bucket=bucket, Key="v/index.json", Body=json.dumps(doc).encode())
    assert main(["verify", f"s3://{bucket}/v", "--endpoint-url", options["endpoint_url"]]) == 1
    assert "shard-000001.tar: holds 10 samples, the manifest says 9" in capsys.readouterr().out


def test_index_webdataset_shards_then_stream_them(tmp_path, capsys):
    samples = [{"__key__": f"k{i:03d}", "txt": f"t{i}", "cls": i} for i in range(45)]
    with wds.ShardWriter(str(tmp_path / "w-%02d.tar"), maxcount=20, verbose=0) as w:
        for s in samples:
            w.write(s)
    assert main(["index", str(tmp_path / "w-{00..02}.tar"), str(tmp_path)]) == 0
    assert "indexed 3 shards, 45 samples" in capsys.readouterr().out
    doc = json.loads((tmp_path / "index.json").read_text())
    assert doc["shards"]["path"] == ["w-00.tar", "w-01.tar", "w-02.tar"]
    ds = ShardStream(str(tmp_path), batch_size=5, shuffle=False, world=World(0, 1))
    assert [k for b in ds for k in b["__key__"]] == [s["__key__"] for s in samples]
    assert main(["verify", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["index", str(tmp_path / "w-*.tar"), str(tmp_path)]) == 1
    assert "exists; pass --overwrite" in capsys.readouterr().err


def test_index_without_dest_is_one_line_naming_what_to_run(tmp_path):
    """Forgetting DEST (or giving --upgrade two inputs) is one line and exit 1, as the CLI's other
    errors are, not a traceback; for a local folder it names the command that indexes it."""
    with wds.ShardWriter(str(tmp_path / "w-%02d.tar"), maxcount=20, verbose=0) as w:
        w.write({"__key__": "k0", "txt": "t0"})
    q = shlex.quote(str(tmp_path))
    needs = "index needs SHARDS... DEST, the manifest's directory or .json path last"
    cases = [
        (
            ["index", str(tmp_path)],
            f"{needs} (this folder's shards: shardstream index {q} DEST, DEST a folder of its own for the manifest, or {q} to write it beside them)",
        ),
        (["index", str(tmp_path / "w-*.tar")], needs),
        (["index", "--upgrade", str(tmp_path), str(tmp_path)], "index --upgrade takes one dataset root or index.json, got 2"),
    ]
    for argv, line in cases:
        done = subprocess.run([sys.executable, "-m", "shardstream", *argv], capture_output=True, text=True, timeout=scaled(60))
        assert (done.returncode, done.stdout, done.stderr) == (1, "", f"shardstream index: error: {line}\n")
    assert not (tmp_path / "index.json").exists()


def test_allow_root_reaches_every_command_that_reads_a_manifest(tmp_path, capsys):
    # A dataset whose manifest lists its shards outside its root (../elsewhere/) is refused unless
    # --allow-root names that place: pack's source side, merge's parts, index --upgrade and bench
    # read it as ls does.
    elsewhere = tmp_path / "elsewhere"
    write_dataset(elsewhere, n=30, max_count=10)
    doc = json.loads((elsewhere / "index.json").read_text())
    doc["shards"]["path"] = [f"../elsewhere/{p}" for p in doc["shards"]["path"]]
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "index.json").write_text(json.dumps(doc))
    ds = str(tmp_path / "ds")
    commands = [
        ["ls", ds],
        ["pack", ds, str(tmp_path / "packed"), "--no-progress"],
        ["merge", str(tmp_path / "merged"), ds],
        ["index", "--upgrade", ds],
        ["bench", ds, "--workers", "0", "--batch-size", "10", "--seconds", "0.2"],
    ]
    for argv in commands:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert "shard #0 '../elsewhere/shard-000000.tar' points outside the dataset's root" in err and "--allow-root" in err, err
        assert main([*argv, "--allow-root", str(elsewhere)]) == 0, argv
        capsys.readouterr()
    keys = [s["__key__"] for s in make_samples(30)]
    for packed in ("packed", "merged"):
        ds2 = ShardStream(str(tmp_path / packed), batch_size=10, shuffle=False, world=World(0, 1))
        assert [k for b in ds2 for k in b["__key__"]] == keys, packed


def test_bench_reports_and_plots(packed, tmp_path, capsys):
    plot = tmp_path / "p.png"
    assert main(["bench", str(packed), "--workers", "1", "--batch-size", "2", "--seconds", "0.5", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 0 ") or line.startswith("| 1 ")]
    assert len(rows) == 2 and all("samples/s" not in r for r in rows)
    assert "recommendation: num_workers=" in out and "give --step-ms" in out
    assert Image.open(plot).size == (1120, 440)


def test_bench_measures_the_workers_memory_and_the_spread_over_repeats(tmp_path, capsys, monkeypatch):
    # The table and plot said 0 MB for every worker count: getrusage(RUSAGE_CHILDREN) sees neither
    # forkserver workers (not this process's children) nor live forked ones (not yet reaped).
    from shardstream.cli import bench

    write_image_folder(tmp_path / "src", classes=3, per_class=100, with_json=False)
    pack(str(tmp_path / "src"), str(tmp_path / "ds"), label_from_dir=True, max_count=50)
    drawn = []
    original = bench.draw_plot
    monkeypatch.setattr(bench, "draw_plot", lambda results, path, title="": drawn.append(results) or original(results, path, title))
    plot = tmp_path / "p.png"
    argv = ["bench", str(tmp_path / "ds"), "--workers", "2", "--runtime", "processes", "--batch-size", "2", "--seconds", "1.5", "--repeats", "2"]
    argv += ["--plot", str(plot)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "medians of 2 runs per count" in out
    (results,) = drawn
    assert [r["workers"] for r in results] == [0, 1, 2] and all(r["repeats"] == 2 for r in results)
    main_peak = [r["peak_rss_mb"] for r in results]
    per_worker = [r["peak_worker_rss_mb"] for r in results]
    total = [r["peak_total_rss_mb"] for r in results]
    assert all(m > 50 for m in main_peak), main_peak  # a Python process with torch
    assert per_worker[0] == 0 and per_worker[1] > 20 and per_worker[2] > 20, per_worker
    assert total[0] >= main_peak[0] * 0.9 and total[0] < total[1] < total[2], total  # each worker adds its memory
    for r in results:
        low, high = r["samples_per_s_range"]
        assert low <= r["samples_per_s"] <= high
    assert Image.open(plot).size == (1120, 440)


def test_bench_with_a_busy_training_step_advises_for_training(packed, capsys):
    assert main(["bench", str(packed), "--workers", "1", "--batch-size", "2", "--seconds", "0.5", "--step-ms", "5"]) == 0
    out = capsys.readouterr().out
    assert "recommendation: num_workers=1" in out and "with a 5 ms step" in out and "% of the time waiting" in out


def test_plot_labels_say_units_settings_and_plurals():
    from shardstream.cli.bench import recommend, workers_label

    assert [workers_label(n) for n in (0, 1, 2)] == ["0 workers", "1 worker", "2 workers"]
    results = [{"workers": w, "samples_per_s": s, "consumer_wait_s": 0.0, "seconds": 1.0} for w, s in ((0, 900), (1, 990), (2, 1000))]
    assert recommend(results, 0).startswith("recommendation: num_workers=1 ")  # the fewest within 5% of the best


def test_a_mistyped_flag_or_command_gets_a_suggestion(capsys):
    with pytest.raises(SystemExit):
        main(["pack", "a", "b", "--overwite"])
    assert "--overwite: did you mean --overwrite?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "a", "--step-sm", "3"])
    assert "did you mean --step-ms?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["verfy", "a"])
    assert "did you mean 'verify'?" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # flags of an argument group: the storage flags, ls's request accounting
        main(["ls", "a", "--endpont-url", "x", "--batch-sise", "4"])
    err = capsys.readouterr().err
    assert "--endpont-url: did you mean --endpoint-url?" in err and "--batch-sise: did you mean --batch-size?" in err


def test_errors_are_one_line_unless_debug(tmp_path, capsys):
    assert main(["ls", str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read the manifest" in err and "Traceback" not in err
    from shardstream.errors import ManifestError

    with pytest.raises(ManifestError):
        main(["--debug", "ls", str(tmp_path / "nothing")])


def test_a_reader_that_stops_early_ends_the_command_quietly(tmp_path):
    """`shardstream ls DATASET | head -1`: the closed pipe ends the command with 141 (as SIGPIPE
    would) and nothing on stderr, no BrokenPipeError traceback. The listing (3000 labels, about
    200 KB) is far more than the pipe holds, so the command is still writing when head exits."""
    labels = {f"class-{i:05d}-{'x' * 50}": i for i in range(3000)}
    with ShardWriter(str(tmp_path / "ds"), label_map=labels) as w:
        w.write({"__key__": "a", "cls": 0, "txt": "x"})
    exe = Path(sys.executable).with_name("shardstream")
    command = f"{shlex.quote(str(exe))} ls {shlex.quote(str(tmp_path / 'ds'))} | head -1"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=scaled(120))
    assert done.stdout == f"{tmp_path / 'ds' / 'index.json'}\n"
    assert done.stderr == "" and done.returncode == 141


def test_show_previews_an_npy_field_as_verify_deep_reads_it(tmp_path, capsys):
    import numpy as np

    samples = [{"__key__": f"a{i}", "npy": np.arange(12, dtype=np.float32).reshape(3, 4) + i, "cls": i} for i in range(3)]
    write_dataset(tmp_path / "d", samples=samples)
    assert main(["verify", str(tmp_path / "d"), "--deep"]) == 0
    capsys.readouterr()
    assert main(["show", str(tmp_path / "d"), "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("array shape=(3, 4) dtype=float32") == 2 and "unreadable" not in out


def _stream_keys(url, **kwargs):
    ds = ShardStream(str(url), batch_size=5, shuffle=False, world=World(0, 1), **kwargs)
    return [k for b in ds for k in b["__key__"]]


def test_merge_lists_shard_paths_that_exist_however_the_parts_are_spelled(tmp_path, monkeypatch, capsys):
    # docs/cli.md's `shardstream merge ./all ./day-01 ./day-02`: siblings of DEST, spelled with ./
    # from the working directory (the manifest listed ./all/./day-01/...: nothing streamed).
    monkeypatch.chdir(tmp_path)
    days = [make_samples(25, seed=d) for d in range(3)]
    for d, samples in enumerate(days):
        for s in samples:
            s["__key__"] = f"d{d}-{s['__key__']}"
    write_dataset(tmp_path / "day-01", samples=days[0], max_count=10)
    write_dataset(tmp_path / "day-02", samples=days[1], max_count=10)
    write_dataset(tmp_path / "all" / "day-03", samples=days[2], max_count=10)
    every = [s["__key__"] for samples in days for s in samples]
    assert main(["merge", "./all", "./day-01", "./day-02"]) == 0
    capsys.readouterr()
    doc = json.loads((tmp_path / "all" / "index.json").read_text())
    assert all(Path(p).is_absolute() and Path(p).exists() for p in doc["shards"]["path"]), doc["shards"]["path"]
    assert _stream_keys("./all") == every[:50]
    # Every spelling of a part under DEST (./, ../, file://, absolute) is stored relative to DEST; a
    # sibling by its absolute path; DEST named as a part (growing it) in another spelling still counts.
    assert main(["merge", "all", f"file://{tmp_path}/all", "./all/../all/day-03/"]) == 0
    capsys.readouterr()
    doc = json.loads((tmp_path / "all" / "index.json").read_text())
    assert doc["shards"]["path"][-3:] == ["day-03/shard-000000.tar", "day-03/shard-000001.tar", "day-03/shard-000002.tar"]
    assert _stream_keys(tmp_path / "all") == every
    # The merged dataset moves as a whole where its parts are under it; a merged DEST elsewhere
    # (not a parent of the parts) reads them all by absolute path.
    assert main(["merge", str(tmp_path / "elsewhere" / "m"), "./all/day-03", "day-02"]) == 0
    capsys.readouterr()
    assert _stream_keys(tmp_path / "elsewhere" / "m") == every[50:] + every[25:50]
    assert main(["merge", "./all2", "./all", "./day-01"]) == 1
    assert "is listed by both" in capsys.readouterr().err  # the same shard, spelled two ways, is one shard


def test_merge_on_s3_normalises_part_urls_and_refuses_local_shards(s3, tmp_path, capsys):
    bucket, options, _ = s3
    endpoint = ["--endpoint-url", options["endpoint_url"]]
    samples = make_samples(30)
    write_dataset(f"s3://{bucket}/all/a", samples=samples[:15], max_count=10, storage_options=options)
    write_dataset(f"s3://{bucket}/all/b", samples=samples[15:], max_count=10, storage_options=options)
    assert main(["merge", f"s3://{bucket}/all/./", f"s3://{bucket}/all/./a", f"s3://{bucket}/all/x/../b/", *endpoint]) == 0
    capsys.readouterr()
    from shardstream.format.manifest import load_manifest
    from shardstream.options import Store

    manifest = load_manifest(f"s3://{bucket}/all", options)
    assert list(manifest.paths) == ["a/shard-000000.tar", "a/shard-000001.tar", "b/shard-000000.tar", "b/shard-000001.tar"]
    assert _stream_keys(f"s3://{bucket}/all", store=Store(options=options)) == [s["__key__"] for s in samples]
    write_dataset(tmp_path / "local", n=5)
    assert main(["merge", f"s3://{bucket}/all2", str(tmp_path / "local"), *endpoint]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a remote manifest cannot list local shards" in err


def test_an_unknown_profile_is_one_line_naming_it_and_where_profiles_are_read(s3, tmp_path, monkeypatch, capsys):
    bucket, options, _ = s3
    config = tmp_path / "aws-config"
    config.write_text("[profile good]\nregion = us-east-1\naws_access_key_id = testing\naws_secret_access_key = testing\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    url = write_dataset(f"s3://{bucket}/p", n=10, storage_options=options)
    write_dataset(tmp_path / "local", n=10)
    flags = ["--endpoint-url", options["endpoint_url"]]
    commands = [
        ["ls", url],
        ["show", url],
        ["verify", url],
        ["bench", url, "--workers", "0", "--batch-size", "5", "--seconds", "0.2"],
        ["pack", str(tmp_path / "local"), f"s3://{bucket}/packed", "--no-progress"],
        ["index", f"{url}/*.tar", f"s3://{bucket}/indexed"],
        ["merge", f"s3://{bucket}/merged", url],
    ]
    for argv in commands:
        assert main([*argv, *flags, "--profile", "nope"]) == 1, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert "AWS profile 'nope' not found" in err and str(config) in err and "'good'" in err, err
        assert main([*argv, *flags, "--profile", "good"]) == 0, argv  # a profile that exists works
        capsys.readouterr()
    # The Python API: a ConfigError (a mistake in the options, never retried), at the first use.
    from shardstream.errors import ConfigError
    from shardstream.options import Store

    with pytest.raises(ConfigError, match="AWS profile 'nope' not found"):
        ShardStream(url, batch_size=5, world=World(0, 1), store=Store(options={**options, "profile": "nope"}))
    monkeypatch.setenv("AWS_PROFILE", "gone")  # the same for the environment's profile
    with pytest.raises(ConfigError, match="AWS AWS_PROFILE 'gone' not found"):
        ShardStream(url, batch_size=5, world=World(0, 1), store=Store(options=options))

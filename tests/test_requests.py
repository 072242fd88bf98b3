"""How many requests a read makes. On S3 a range is one GET whatever the read size, on the obstore
path and on s3fs's, with and without read-ahead and DataLoader workers (counted by a proxy in front
of the moto server); a new request is made only to resume after a break, from the byte reached;
read-ahead sends the next range's request before the current range's last block is in. And how
many an epoch makes, counted from its plan alone (plan/requests.py), for one dataset or a mix,
against the ranges every (rank, worker) reads and the GETs a read through the proxy makes."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from conftest import make_samples, write_dataset
from faultproxy import FaultProxy

from shardstream import Read, ShardStream, Store, World, make_loader
from shardstream.format.members import MEMBER_CACHE
from shardstream.format.offsets import OFFSET_CACHE
from shardstream.plan.requests import count_requests
from shardstream.storage.config import StorageConfig
from shardstream.storage.readahead import SENT_AHEAD, Prefetcher
from shardstream.storage.retry import Fetcher, RangeReader


def _shard_gets(proxy: FaultProxy, bucket: str) -> Counter:
    """GETs per object key (and the Range each asked for), from the proxy's log."""
    return Counter(
        (path.split(f"/{bucket}/", 1)[1].split("?")[0], rng) for method, path, rng in proxy.log if method == "GET" and f"/{bucket}/" in path
    )


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("readahead", [0, None], ids=["no-readahead", "readahead"])
@pytest.mark.parametrize("s3_client", ["obstore", "s3fs"])
def test_a_whole_shard_is_one_get_and_its_member_sidecar_one_on_both_paths(s3, s3_client, readahead, workers):
    bucket, options, _ = s3
    # 4 shards of 20 samples; batch 5 and 2 workers split them at shard boundaries (2 shards each)
    url = write_dataset(f"s3://{bucket}/one", 80, max_count=20, size=6000, storage_options=options)
    OFFSET_CACHE.clear()
    MEMBER_CACHE.clear()
    with FaultProxy(options["endpoint_url"]) as proxy:
        ds = ShardStream(
            url,
            batch_size=5,
            shuffle=False,
            world=World(0, 1),
            store=Store(
                options={"endpoint_url": proxy.url},
                config=StorageConfig(s3_client=s3_client),
                read=Read(read_size=16 << 10, readahead_bytes=readahead),
            ),
        )
        keys = [k for b in make_loader(ds, num_workers=workers, pin_memory=False, log_interval=None) for k in b["__key__"]]
        gets = _shard_gets(proxy, bucket)
    assert sorted(keys) == [s["__key__"] for s in make_samples(80)]
    m = ds.manifest
    expected = {(f"one/shard-{i:06d}.tar", f"bytes={int(m.spans[i, 0])}-{int(m.sizes[i]) - 1}"): 1 for i in range(4)}
    # its member sidecar, once (pack wrote one: the shard is sliced, not parsed), in one ranged GET
    # a byte longer than the manifest says (a longer file shows), and no offset sidecar
    expected.update({(f"one/shard-{i:06d}.tar.members", f"bytes=0-{int(m.member_bytes[i])}"): 1 for i in range(4)})
    expected[("one/index.json", f"bytes=0-{(8 << 20) - 1}")] = 1  # the manifest: read once, by the main process
    assert dict(gets) == expected  # one GET per shard, through its end, and its member sidecar's; nothing else
    assert ds.stats()["requests"] == 4 and ds.stats()["retries"] == 0 and ds.stats()["ranges_sliced"] == 4
    count = count_requests(ds.plan(num_workers=max(1, workers)), m)  # what the plan's summary says
    assert (count.ranges, count.sidecars) == (4, 4)


@pytest.mark.parametrize("s3_client", ["obstore", "s3fs"])
def test_a_range_inside_a_shard_is_one_get_after_its_sidecar(s3, s3_client):
    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/part", 80, max_count=20, size=6000, storage_options=options)
    OFFSET_CACHE.clear()
    MEMBER_CACHE.clear()
    with FaultProxy(options["endpoint_url"]) as proxy:
        # 3 ranks of 5 batches of 5: rank 0 reads shard 0 whole and samples [0, 5) of shard 1
        ds = ShardStream(
            url,
            batch_size=5,
            shuffle=False,
            world=World(0, 3),
            store=Store(options={"endpoint_url": proxy.url}, config=StorageConfig(s3_client=s3_client), read=Read(read_size=16 << 10)),
        )
        assert sum(len(b["__key__"]) for b in ds) == 25
        gets = _shard_gets(proxy, bucket)
    offsets = ds.manifest.member_table(1).offsets  # (read for the range, cached: no request here)
    assert gets[("part/shard-000001.tar", f"bytes={int(offsets[0])}-{int(offsets[5]) - 1}")] == 1
    # the shard's member sidecar (pack's) holds its offsets: read in place of the offset sidecar
    assert sum(n for (key, _), n in gets.items() if key == "part/shard-000001.tar.members") == 1
    assert not [key for key, _ in gets if key.endswith(".idx")] and ds.stats()["ranges_sliced"] == 2
    assert sum(n for (key, _), n in gets.items() if key.endswith(".tar")) == 2
    assert ds.stats()["requests"] == 2
    # shard 0, read whole, was sliced too: its member sidecar once; 2 sidecars, as the plan counts
    assert sum(n for (key, _), n in gets.items() if key == "part/shard-000000.tar.members") == 1
    count = count_requests(ds.plan(), ds.manifest)
    assert count.sidecars == 3 * 2  # ranks 0 and 2 read two shards each, rank 1 two (shards 1 and 2)


@pytest.mark.parametrize("cut", ["rst", "fin"])
@pytest.mark.parametrize("s3_client", ["obstore", "s3fs"])
def test_a_new_request_only_to_resume_a_broken_body(s3, s3_client, cut):
    """Every body is cut after 30 KB: each following request starts at the byte the one before
    reached, and the requests are one per shard plus one per resume."""
    bucket, options, _ = s3
    samples = make_samples(20, size=20_000, seed=5)
    url = write_dataset(f"s3://{bucket}/cut", samples=samples, max_count=20, storage_options=options)
    config = StorageConfig(s3_client=s3_client, backoff_base=0.001, backoff_cap=0.01)
    with FaultProxy(options["endpoint_url"], reset_after=30_000, cut=cut) as proxy:
        ds = ShardStream(
            url,
            batch_size=4,
            shuffle=False,
            world=World(0, 1),
            store=Store(options={"endpoint_url": proxy.url}, config=config, read=Read(read_size=64 << 10)),
        )
        got = {k: bytes(b) for batch in ds for k, b in zip(batch["__key__"], batch["bin"])}
        ranges = [rng for method, path, rng in proxy.log if method == "GET" and path.endswith("shard-000000.tar")]
    stats = ds.stats()
    assert got == {s["__key__"]: s["bin"] for s in samples}
    size = int(ds.manifest.sizes[0])
    starts = [int(r.split("=")[1].split("-")[0]) for r in ranges]
    assert all(r.endswith(f"-{size - 1}") for r in ranges)  # every request runs to the object's end
    assert starts == sorted(set(starts)) and len(starts) > 3  # each resumes further on, none repeats a byte range
    assert stats["requests"] == len(ranges) == 1 + stats["resumes"]
    assert stats["bytes_read"] == size - int(ds.manifest.spans[0, 0])


class _Body:
    def __init__(self, data: bytes, log: list, cut: int | None):
        self.data, self.log, self.cut, self.at, self.closed = data, log, cut, 0, False

    def readinto(self, view, timeout=None):
        if self.cut is not None and self.at >= self.cut:
            raise ConnectionResetError("cut")
        stop = len(self.data) if self.cut is None else min(len(self.data), self.cut)
        k = min(len(view), stop - self.at, 1000)  # a receive at a time
        view[:k] = self.data[self.at : self.at + k]
        self.at += k
        return k

    def close(self):
        self.closed = True
        self.log.append(("close", self.at))


def _fetcher(data: bytes, log: list, cut_every: int | None = None) -> Fetcher:
    def open_body(a, b, timeout=None):
        log.append(("open", a, b))
        return _Body(data[a:b], log, cut_every)

    return Fetcher("test", open_body)


def test_a_range_reader_reads_every_block_from_one_body_and_resumes_at_the_byte_reached():
    data = bytes(range(256)) * 400  # 102,400 bytes
    log: list = []
    read = RangeReader(_fetcher(data, log), url="s3://b/k", start=100, end=90_000)
    out = b"".join(iter(lambda: bytes(read(7_000)), b""))
    assert out == data[100:90_000]
    assert [e for e in log if e[0] == "open"] == [("open", 100, 90_000)]
    assert log[-1] == ("close", 89_900)  # read to its end: closed (the connection serves the next request)

    log.clear()
    read = RangeReader(
        _fetcher(data, log, cut_every=25_000), url="s3://b/k", start=0, end=len(data), config=StorageConfig(backoff_base=0, backoff_cap=0)
    )
    view = memoryview(bytearray(len(data)))
    got = 0
    while k := read.readinto(view[got:]):  # into the caller's buffer, as the parser fills a large member
        got += k
    assert bytes(view[:got]) == data
    assert [e[1] for e in log if e[0] == "open"] == [0, 25_000, 50_000, 75_000, 100_000]

    log.clear()
    read = RangeReader(_fetcher(data, log), url="s3://b/k", start=0, end=len(data))
    read(10)
    read.close()  # abandoned halfway: its body is closed
    assert log == [("open", 0, len(data)), ("close", 10)]


class _Reader:
    """A range of ``size`` bytes that records when its request is sent and when its blocks are read."""

    def __init__(self, index: int, size: int, events: list, lock: threading.Lock):
        self.index, self.left, self.events, self.lock = index, size, events, lock

    def start(self):
        with self.lock:
            self.events.append(("start", self.index))

    def remaining(self):
        return self.left

    def __call__(self, n):
        k = min(n, self.left)
        self.left -= k
        with self.lock:
            self.events.append(("read", self.index, self.left))
        return b"x" * k


def test_read_ahead_sends_the_next_ranges_request_before_this_ones_last_block():
    events: list = []
    lock = threading.Lock()
    sizes = [1_000, 1_000, 50, 50, 50, 50, 50, 50, 50, 1_000]

    def opener(i):
        return lambda: (_Reader(i, sizes[i], events, lock), lambda: None)

    p = Prefetcher([opener(i) for i in range(len(sizes))], block_size=100, max_bytes=300)
    try:
        for i, size in enumerate(sizes):
            read, got = p.reader(i), 0
            while block := read(1 << 20):
                got += len(block)
            assert got == size
    finally:
        p.close()
    with lock:
        log = list(events)
    for i in range(1, len(sizes)):
        sent = log.index(("start", i))
        # the request went out once what was left to fetch before it fit in the bound, before
        # the previous range's last block was read
        assert sent < log.index(("read", i - 1, 0))
    before_second = log[: log.index(("start", 1))]
    assert ("read", 0, 300) in before_second and ("read", 0, 200) not in before_second  # not earlier either
    # never more than SENT_AHEAD ranges asked for beyond the one being fetched (which may not have
    # read its first block yet: one past the last range read)
    for at, event in enumerate(log):
        if event[0] == "start":
            reading = max([e[1] for e in log[:at] if e[0] == "read"], default=0)
            assert event[1] - reading <= SENT_AHEAD + 1


# -- request accounting (pure: the plan and the manifest's columns) ---------------------------------
def _manifest(counts, prefixes=1, base="s3://b/train"):
    from shardstream.format.manifest import Manifest, ShardInfo

    shards = [
        ShardInfo(path=(f"{i % prefixes}/" if prefixes > 1 else "") + f"shard-{i:06d}.tar", samples=c, bytes=1000 * c + 1024, sha256=None)
        for i, c in enumerate(counts)
    ]
    return Manifest(shards=shards, base_url=base)


@pytest.mark.parametrize(
    "world,workers,batch,mode,shuffle",
    [
        (1, 1, 4, "drop", False),
        (2, 3, 5, "drop", True),
        (3, 2, 7, "pad", True),
        (4, 4, 3, "drop", True),
        (5, 1, 16, "pad", False),
        (2, 2, 1, "drop", True),
    ],
)
def test_request_counts_are_those_of_the_planned_ranges(world, workers, batch, mode, shuffle):
    """count_requests, vectorised, against every (rank, worker)'s ranges listed one by one: one GET
    per range, one sidecar per (worker, shard) with a range that starts or ends inside the shard."""
    import numpy as np

    from shardstream.plan.epoch import plan_epoch
    from shardstream.plan.requests import count_requests

    counts = np.random.default_rng(world * 10 + workers).integers(1, 30, 23)
    manifest = _manifest(counts.tolist(), prefixes=3)
    plan = plan_epoch(counts, world_size=world, num_workers=workers, batch_size=batch, seed=1, epoch=2, shuffle=shuffle, mode=mode)
    ranges = {(r, w): plan.ranges(r, w, counts) for r in range(world) for w in range(workers)}
    got = count_requests(plan, manifest)
    assert got.ranges == sum(len(v) for v in ranges.values())
    partial = {(r, w, x.shard) for (r, w), rs in ranges.items() for x in rs if x.start > 0 or x.stop < counts[x.shard]}
    assert got.sidecars == len(partial)
    per_prefix: dict[str, int] = {}
    for rs in ranges.values():
        for x in rs:
            per_prefix[str(x.shard % 3)] = per_prefix.get(str(x.shard % 3), 0) + 1
    for _, _, shard in partial:
        per_prefix[str(shard % 3)] += 1
    assert {name.rsplit("/", 1)[1]: n for name, n in got.by_prefix} == per_prefix
    assert got.by_prefix[0][1] == max(per_prefix.values())


def test_the_summary_states_gets_per_second_and_warns_past_s3s_rate_per_prefix():
    from shardstream.plan.epoch import plan_epoch
    from shardstream.plan.requests import S3_GETS_PER_PREFIX, count_requests

    counts = [10] * 1_000  # 1,000 shards of ~11 KB: a GET per 11 KB
    plan = plan_epoch(counts, world_size=8, num_workers=4, batch_size=10, shuffle=True)
    one = count_requests(plan, _manifest(counts))
    assert one.ranges == 1_000 and one.sidecars == 0 and one.world_size == 8
    assert one.per_second(1e7) == pytest.approx(1_000 / (one.bytes / 8e7))
    assert one.busiest(1e7) == ("s3://b/train", pytest.approx(one.per_second(1e7)))
    assert one.per_second(1e7) > S3_GETS_PER_PREFIX and "WARNING" in one.describe(1e7)
    assert "pack --prefixes" in one.describe(1e7)
    spread = count_requests(plan, _manifest(counts, prefixes=4))  # the same GETs over 4 prefixes
    assert spread.gets == one.gets and len(spread.by_prefix) == 4
    assert spread.busiest(1e7)[1] == pytest.approx(one.per_second(1e7) / 4)
    assert spread.warning(1e7) is None and "WARNING" not in spread.describe(1e7)
    assert "1,000 GETs per epoch" in one.describe(1e7)


def test_pack_spreads_shards_over_prefixes_that_the_manifest_finds_and_ls_counts(s3, tmp_path, capsys):
    import json

    from shardstream.cli.main import main
    from shardstream.write.writer import shard_name

    assert [shard_name("shard", i, 16) for i in (0, 1, 15, 16)] == [
        "00/shard-000000.tar",
        "01/shard-000001.tar",
        "15/shard-000015.tar",
        "00/shard-000016.tar",
    ]
    assert shard_name("shard", 7, 1) == "shard-000007.tar" and shard_name("x", 7, 3) == "1/x-000007.tar"
    bucket, options, client = s3
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"__key__": f"k{i:03d}", "txt": f"sample {i}"}) + "\n" for i in range(50)))
    dest = f"s3://{bucket}/spread"
    endpoint = ["--endpoint-url", options["endpoint_url"]]
    assert main(["pack", str(src), dest, "--max-count", "5", "--prefixes", "4", "--no-progress", *endpoint]) == 0
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="spread/")["Contents"])
    assert "spread/0/shard-000000.tar" in keys and "spread/3/shard-000007.tar" in keys and "spread/1/shard-000009.tar.idx" in keys
    assert {k.split("/")[1] for k in keys if k.endswith(".tar")} == {"0", "1", "2", "3"}
    ds = ShardStream(dest, batch_size=5, shuffle=False, world=World(0, 1), store=Store(options=options))
    assert ds.manifest.paths[:5] == ["0/shard-000000.tar", "1/shard-000001.tar", "2/shard-000002.tar", "3/shard-000003.tar", "0/shard-000004.tar"]
    assert [k for b in ds for k in b["__key__"]] == [f"k{i:03d}" for i in range(50)]
    summary = ds.plan(num_workers=2).summary()  # a remote dataset's plan states its requests
    # 10 whole shards, and the member sidecar of each (pack wrote them: the shards are sliced)
    assert "requests: 20 GETs per epoch" in summary and "+ at most 10 sidecars" in summary and "busiest of 4 prefixes" in summary
    capsys.readouterr()
    assert main(["ls", dest, "--world", "2", "--workers", "1", "--rate", "10KB", "--json", *endpoint]) == 0
    listed = json.loads(capsys.readouterr().out)["requests"]
    assert listed["prefixes"] == 4 and listed["ranges"] >= 10 and listed["warning"] is None
    assert main(["ls", dest, "--world", "2", "--workers", "1", *endpoint]) == 0  # 1 GB/s per rank of ~5 KB shards
    out, err = capsys.readouterr()
    assert "GETs per epoch" in out and "above S3's 5,500 per prefix" in err
    # packed again over 2 prefixes: the shards of the 4-prefix layout are gone, the new ones read
    assert main(["pack", str(src), dest, "--max-count", "10", "--prefixes", "2", "--overwrite", "--no-progress", *endpoint]) == 0
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="spread/")["Contents"])
    assert [k for k in keys if k.endswith(".tar")] == [f"spread/{i % 2}/shard-{i:06d}.tar" for i in (0, 2, 4, 1, 3)]
    again = ShardStream(dest, batch_size=5, shuffle=False, world=World(0, 1), store=Store(options=options))
    assert [k for b in again for k in b["__key__"]] == [f"k{i:03d}" for i in range(50)]


def test_prefixes_pack_the_same_bytes_with_tasks_as_in_one_process(tmp_path):
    from shardstream.write.pack import pack

    def make(i):
        return {"__key__": f"k{i:04d}", "txt": f"text {i}" * (i % 7 + 1)}

    one = pack(make, range(40), str(tmp_path / "one"), max_count=6, prefixes=3)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:
        tasks = pack(make, range(40), str(tmp_path / "tasks"), max_count=6, prefixes=3, executor=pool)
    assert one.manifest.paths == tasks.manifest.paths and one.manifest.paths[3] == "0/shard-000003.tar"
    for path in one.manifest.paths:
        assert (tmp_path / "one" / path).read_bytes() == (tmp_path / "tasks" / path).read_bytes()
    assert not [p for p in (tmp_path / "tasks").rglob("*") if ".partial-" in p.name]
    ds = ShardStream(str(tmp_path / "tasks"), batch_size=4, shuffle=False, world=World(0, 1))
    assert [k for b in ds for k in b["__key__"]] == [f"k{i:04d}" for i in range(40)]
    assert "requests" not in ds.plan().summary()  # local disk: no request line


# -- a mix: every source counted on its own manifest, from the plan's per-worker reads ----------------
def _listed_mix_requests(run, workers, manifests):
    """Ranges, sidecars and GETs per prefix of a mix's epoch 0, from every (rank, worker)'s reads as
    the pass plan hands them out (``PassPlan.worker``), one range at a time; local sources skipped."""
    from shardstream.plan.requests import is_remote

    plan = run.pass_plan(0, workers)
    ranges, partial, per_prefix = 0, set(), Counter()
    for rank in range(run.settings.world_size):
        for worker in range(workers):
            for window in plan.worker(rank, worker).windows:
                for i, read in enumerate(window.sources):
                    m = manifests[i]
                    assert not read.back  # a fresh pass reads nothing back
                    if not is_remote(m):
                        continue
                    for x in read.ranges:
                        prefix = m.shard_url(x.shard).rsplit("/", 1)[0]
                        ranges += 1
                        per_prefix[prefix] += 1
                        if (x.start > 0 or x.stop < m.counts[x.shard]) and (rank, worker, i, x.shard) not in partial:
                            partial.add((rank, worker, i, x.shard))  # one sidecar per process and shard
                            per_prefix[prefix] += 1
    return ranges, len(partial), dict(per_prefix)


def _mix_run(counts, asks, *, world, batch, mode="drop", per_batch="spread", shuffle=True):
    from schedule_sim import make_run, make_sources

    return make_run(make_sources(counts, asks), world=world, batch=batch, mode=mode, per_batch=per_batch, shuffle=shuffle)


@pytest.mark.parametrize(
    "world,workers,batch,mode,per_batch,shuffle",
    [
        (1, 1, 4, "drop", "spread", False),
        (3, 2, 5, "drop", "spread", True),
        (3, 1, 7, "pad", "spread", True),
        (1, 2, 9, "drop", "exact", True),
        (3, 1, 16, "pad", "spread", True),  # fewer samples than a step: the mixed sequence wraps twice
        (2, 2, 1, "drop", "spread", True),
    ],
)
def test_mix_request_counts_are_those_of_every_workers_planned_reads(world, workers, batch, mode, per_batch, shuffle):
    """count_mix_requests, vectorised, against the ranges every (rank, worker) reads of each source:
    passes entered mid-shard (repeat 1.5 draws a second, partial pass), worker slices cutting shards,
    pad mode's wrap; two sources in one prefix add up there."""
    import numpy as np

    from shardstream.plan.mix import Ask
    from shardstream.plan.requests import count_mix_requests

    rng = np.random.default_rng(world * 10 + workers + batch)
    counts = [rng.integers(1, 30, 13).tolist(), rng.integers(1, 20, 7).tolist(), rng.integers(1, 9, 5).tolist()]
    if batch == 16:  # a small mix: 3 ranks x 16 samples is more than an epoch's
        counts = [[3, 5], [2, 1, 4], [2]]
    asks = [Ask(weight=2), Ask(repeat=1.5), Ask(weight=1)]
    manifests = [
        _manifest(counts[0], prefixes=3, base="s3://b/web"),
        _manifest(counts[1], base="s3://b/code"),
        _manifest(counts[2], base="s3://b/code"),
    ]
    run = _mix_run(counts, asks, world=world, batch=batch, mode=mode, per_batch=per_batch, shuffle=shuffle)
    got = count_mix_requests(run.plan_epoch(0, workers), manifests)
    ranges, sidecars, per_prefix = _listed_mix_requests(run, workers, manifests)
    assert (got.ranges, got.sidecars, dict(got.by_prefix)) == (ranges, sidecars, per_prefix)
    assert got.by_prefix[0][1] == max(per_prefix.values())
    assert [name for name, _ in got.parts] == ["s0", "s1", "s2"] and sum(p.gets for _, p in got.parts) == got.gets
    alone = [[m if j == i else _manifest([1], base="/local") for j, m in enumerate(manifests)] for i in range(3)]
    per_source = [_listed_mix_requests(run, workers, ms) for ms in alone]
    assert [(p.ranges, p.sidecars, dict(p.by_prefix)) for _, p in got.parts] == per_source
    code = [dict(p.by_prefix).get("s3://b/code", 0) for _, p in got.parts]
    assert code[1] and code[2] and per_prefix["s3://b/code"] == code[1] + code[2]  # two sources in one prefix add up


def test_a_mix_counts_only_its_remote_sources_and_its_summary_says_so():
    import numpy as np

    from shardstream.plan.mix import Ask
    from shardstream.plan.requests import count_mix_requests, with_requests

    counts = [[20] * 10, [15] * 8]
    run = _mix_run(counts, [Ask(weight=1), Ask(weight=1)], world=2, batch=4)
    plan = run.plan_epoch(0, 2)
    local, remote = _manifest(counts[0], base="/data/curated"), _manifest(counts[1], base="s3://b/web")
    got = count_mix_requests(plan, [local, remote])
    ranges, sidecars, per_prefix = _listed_mix_requests(run, 2, [local, remote])
    assert (got.ranges, got.sidecars, dict(got.by_prefix)) == (ranges, sidecars, per_prefix) and list(per_prefix) == ["s3://b/web"]
    (_, a), (_, b) = got.parts
    assert a.local and a.gets == 0 and a.bytes > 0 and not b.local and b.gets == got.gets
    assert got.bytes == a.bytes + b.bytes and got.remote_bytes == b.bytes  # the local bytes take reading time too
    summary = with_requests(plan, [local, remote]).summary()
    last = summary.splitlines()[-1]
    assert last.startswith(f"  requests: {got.gets:,} GETs per epoch") and "by source: s0 local (no requests), s1 " in last
    assert f"s1 {got.gets:,} GETs ({got.per_second():,.0f} GET/s)" in last
    assert with_requests(plan, [local, _manifest(counts[1], base="file:///data/web")]) is plan  # all local: no line
    assert "requests" not in plan.summary()
    single = np.asarray(counts[1])  # a single dataset's plan and manifest as before
    from shardstream.plan.epoch import plan_epoch

    one = plan_epoch(single, world_size=2, num_workers=2, batch_size=4)
    assert "requests: " in with_requests(one, remote).summary() and with_requests(one, [remote]).summary() == with_requests(one, remote).summary()


def test_a_mix_warns_for_the_busiest_prefix_over_all_its_sources():
    """Two sources, each under S3's rate alone: in one prefix their GETs add up past it; in two, not."""
    from shardstream.plan.mix import Ask
    from shardstream.plan.requests import S3_GETS_PER_PREFIX, count_mix_requests

    counts = [[10] * 500, [10] * 500]  # 1,000 shards of ~11 KB: a GET per 11 KB
    plan = _mix_run(counts, [Ask(weight=1), Ask(weight=1)], world=8, batch=10).plan_epoch(0, 4)
    shared = count_mix_requests(plan, [_manifest(c, base="s3://b/train") for c in counts])
    apart = count_mix_requests(plan, [_manifest(counts[0], base="s3://b/web"), _manifest(counts[1], base="s3://b/code")])
    (_, web), (_, code) = apart.parts
    assert shared.gets == apart.gets == web.gets + code.gets and web.gets == code.gets  # the same reads, one prefix or two
    assert len(shared.by_prefix) == 1 and len(apart.by_prefix) == 2
    rate = 1.5 * S3_GETS_PER_PREFIX * shared.bytes / (shared.gets * 8)  # bytes per second per rank for 1.5 x S3's rate
    assert shared.per_second(rate) == pytest.approx(1.5 * S3_GETS_PER_PREFIX)
    assert shared.busiest(rate) == ("s3://b/train", pytest.approx(1.5 * S3_GETS_PER_PREFIX))
    assert "WARNING: s3://b/train would get 8,250 GET/s" in shared.describe(rate)
    assert apart.busiest(rate)[1] == pytest.approx(0.75 * S3_GETS_PER_PREFIX) and apart.warning(rate) is None
    assert f"by source: s0 {web.gets:,} GETs (4,125 GET/s), s1 {code.gets:,} GETs (4,125 GET/s)" in apart.describe(rate)


def test_a_billion_sample_mix_is_counted_without_listing_its_samples():
    """Two sources of 600M and 400M samples (20,000 shards): the count agrees with the ranges listed
    per worker (a range is a Python value there, a sample never is)."""
    import time

    from shardstream.plan.mix import Ask
    from shardstream.plan.requests import count_mix_requests

    counts = [[50_000] * 12_000, [50_000] * 8_000]
    manifests = [_manifest(counts[0], prefixes=16, base="s3://b/web"), _manifest(counts[1], prefixes=16, base="s3://b/code")]
    run = _mix_run(counts, [Ask(weight=3), Ask(repeat=1.5)], world=16, batch=256)
    plan = run.plan_epoch(0, 4)
    assert plan.total_samples > 10**9
    t = time.perf_counter()
    got = count_mix_requests(plan, manifests)
    took = time.perf_counter() - t
    ranges, sidecars, per_prefix = _listed_mix_requests(run, 4, manifests)
    assert (got.ranges, got.sidecars, dict(got.by_prefix)) == (ranges, sidecars, per_prefix)
    assert len(got.by_prefix) == 32 and took < 5


@pytest.mark.parametrize("world,workers", [(3, 0), (2, 2)])
def test_a_mix_read_from_s3_makes_the_gets_its_plan_counts(s3, world, workers):
    """A mix of two S3 datasets read by every rank (each DataLoader worker a process with its own
    sidecar cache) through a proxy that logs each GET: shard GETs and sidecar GETs as counted."""
    from shardstream import Source
    from shardstream.plan.requests import count_mix_requests

    bucket, options, _ = s3
    web = write_dataset(f"s3://{bucket}/web", 80, max_count=20, size=1500, storage_options=options)
    code = write_dataset(f"s3://{bucket}/code", 45, max_count=15, size=1500, storage_options=options)
    with FaultProxy(options["endpoint_url"]) as proxy:
        store = Store(options={"endpoint_url": proxy.url})
        sources = [Source(web, weight=2, name="web"), Source(code, repeat=1.5, name="code")]

        def stream(rank):
            return ShardStream(sources, batch_size=5, seed=3, world=World(rank, world), store=store)

        plan = stream(0).plan(num_workers=max(1, workers))
        proxy.log.clear()
        for rank in range(world):
            OFFSET_CACHE.clear()  # every rank is a process of its own
            MEMBER_CACHE.clear()
            ds = stream(rank)
            batches = list(make_loader(ds, num_workers=workers, workers="processes", pin_memory=False, log_interval=None) if workers else ds)
            assert len(batches) == len(ds)
        gets = _shard_gets(proxy, bucket)
    count = count_mix_requests(plan, ds.sources.manifests)
    assert count.ranges == sum(n for (key, _), n in gets.items() if key.endswith(".tar"))
    assert count.sidecars == sum(n for (key, _), n in gets.items() if key.endswith((".tar.idx", ".tar.members"))) > 0
    per_prefix: Counter = Counter()
    for (key, _), n in gets.items():
        if ".tar" in key:
            per_prefix[f"s3://{bucket}/{key.split('/')[0]}"] += n
    assert dict(count.by_prefix) == dict(per_prefix)
    summary = plan.summary()
    assert f"requests: {count.gets:,} GETs per epoch" in summary and "by source: web " in summary and ", code " in summary


def test_ls_counts_a_mix_files_requests_as_the_stream_plans_them(s3, tmp_path, capsys):
    import json

    from shardstream.cli.main import main

    bucket, options, _ = s3
    web = write_dataset(f"s3://{bucket}/web", 60, max_count=10, size=500, storage_options=options)
    local = write_dataset(tmp_path / "curated", 30, max_count=10, size=500)
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"sources": [{"url": web, "weight": 2, "name": "web"}, {"url": local, "weight": 1, "name": "curated"}]}))
    endpoint = ["--endpoint-url", options["endpoint_url"]]
    capsys.readouterr()
    assert main(["ls", str(mix), "--world", "2", "--workers", "2", "--json", *endpoint]) == 0
    listed = json.loads(capsys.readouterr().out)["requests"]
    assert listed["by_source"]["curated"] == {"local": True, "gets_per_epoch": 0, "gets_per_second": 0.0}
    assert listed["by_source"]["web"]["gets_per_epoch"] == listed["gets_per_epoch"] > 0 and listed["prefixes"] == 1
    ds = ShardStream(str(mix), batch_size=1, world=World(0, 2), store=Store(options=options))
    assert f"requests: {listed['gets_per_epoch']:,} GETs per epoch" in ds.plan(num_workers=2).summary()  # the stream's own count
    assert main(["ls", str(mix), "--world", "2", *endpoint]) == 0
    out = capsys.readouterr().out
    assert "mix of 2 sources" in out and "by source: web " in out and "curated local (no requests)" in out


@pytest.mark.parametrize("mode", ["drop", "pad"])
def test_ls_counts_one_datasets_requests_as_the_stream_plans_them(s3, capsys, mode):
    """``shardstream ls --mode`` plans a single dataset through the stream's planner: its GETs are
    the ones ``ShardStream(mode=...).plan()`` says (pad mode reads the wrapped tail again)."""
    import json

    from shardstream.cli.main import main

    bucket, options, _ = s3
    dest = write_dataset(f"s3://{bucket}/one-{mode}", 47, max_count=10, size=500, storage_options=options)
    capsys.readouterr()
    flags = ["--world", "2", "--workers", "2", "--batch-size", "4", "--mode", mode, "--json"]
    assert main(["ls", dest, *flags, "--endpoint-url", options["endpoint_url"]]) == 0
    listed = json.loads(capsys.readouterr().out)["requests"]
    ds = ShardStream(dest, batch_size=4, seed=0, mode=mode, world=World(0, 2), store=Store(options=options))
    assert f"requests: {listed['gets_per_epoch']:,} GETs per epoch" in ds.plan(num_workers=2).summary()

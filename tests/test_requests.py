"""How many requests a read makes. On S3 a range is one GET whatever the read size, on the direct
path and on s3fs's, with and without read-ahead and DataLoader workers (counted by a proxy in front
of the moto server); a new request is made only to resume after a break, from the byte reached;
read-ahead sends the next range's request before the current range's last block is in."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from conftest import make_samples, write_dataset
from faultproxy import FaultProxy

from shardstream import Read, ShardStream, Store, World, make_loader
from shardstream.format.offsets import OFFSET_CACHE
from shardstream.storage.config import StorageConfig
from shardstream.storage.readahead import SENT_AHEAD, Prefetcher
from shardstream.storage.retry import Fetcher, make_range_reader


def _shard_gets(proxy: FaultProxy, bucket: str) -> Counter:
    """GETs per object key (and the Range each asked for), from the proxy's log."""
    return Counter(
        (path.split(f"/{bucket}/", 1)[1].split("?")[0], rng) for method, path, rng in proxy.log if method == "GET" and f"/{bucket}/" in path
    )


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("readahead", [0, None], ids=["no-readahead", "readahead"])
@pytest.mark.parametrize("direct_get", [True, False], ids=["direct", "s3fs"])
def test_a_whole_shard_is_one_get_on_both_paths(s3, direct_get, readahead, workers):
    bucket, options, _ = s3
    # 4 shards of 20 samples; batch 5 and 2 workers split them at shard boundaries (2 shards each)
    url = write_dataset(f"s3://{bucket}/one", 80, max_count=20, size=6000, storage_options=options)
    OFFSET_CACHE.clear()
    with FaultProxy(options["endpoint_url"]) as proxy:
        ds = ShardStream(
            url,
            batch_size=5,
            shuffle=False,
            world=World(0, 1),
            store=Store(
                options={"endpoint_url": proxy.url},
                config=StorageConfig(direct_get=direct_get),
                read=Read(read_size=16 << 10, readahead_bytes=readahead),
            ),
        )
        keys = [k for b in make_loader(ds, num_workers=workers, pin_memory=False, log_interval=None) for k in b["__key__"]]
        gets = _shard_gets(proxy, bucket)
    assert sorted(keys) == [s["__key__"] for s in make_samples(80)]
    m = ds.manifest
    expected = {(f"one/shard-{i:06d}.tar", f"bytes={int(m.spans[i, 0])}-{int(m.sizes[i]) - 1}"): 1 for i in range(4)}
    expected[("one/index.json", f"bytes=0-{(8 << 20) - 1}")] = 1  # the manifest: read once, by the main process
    assert dict(gets) == expected  # one GET per shard, through its end; no sidecar, nothing else
    assert ds.stats()["requests"] == 4 and ds.stats()["retries"] == 0


@pytest.mark.parametrize("direct_get", [True, False], ids=["direct", "s3fs"])
def test_a_range_inside_a_shard_is_one_get_after_its_sidecar(s3, direct_get):
    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/part", 80, max_count=20, size=6000, storage_options=options)
    OFFSET_CACHE.clear()
    with FaultProxy(options["endpoint_url"]) as proxy:
        # 3 ranks of 5 batches of 5: rank 0 reads shard 0 whole and samples [0, 5) of shard 1
        ds = ShardStream(
            url,
            batch_size=5,
            shuffle=False,
            world=World(0, 3),
            store=Store(options={"endpoint_url": proxy.url}, config=StorageConfig(direct_get=direct_get), read=Read(read_size=16 << 10)),
        )
        assert sum(len(b["__key__"]) for b in ds) == 25
        gets = _shard_gets(proxy, bucket)
    offsets = ds.manifest.offsets(1)
    assert gets[("part/shard-000001.tar", f"bytes={int(offsets[0])}-{int(offsets[5]) - 1}")] == 1
    assert sum(n for (key, _), n in gets.items() if key == "part/shard-000001.tar.idx") == 1
    assert sum(n for (key, _), n in gets.items() if key.endswith(".tar")) == 2
    assert ds.stats()["requests"] == 2


@pytest.mark.parametrize("cut", ["rst", "fin"])
@pytest.mark.parametrize("direct_get", [True, False], ids=["direct", "s3fs"])
def test_a_new_request_only_to_resume_a_broken_body(s3, direct_get, cut):
    """Every body is cut after 30 KB: each following request starts at the byte the one before
    reached, and the requests are one per shard plus one per resume."""
    bucket, options, _ = s3
    samples = make_samples(20, size=20_000, seed=5)
    url = write_dataset(f"s3://{bucket}/cut", samples=samples, max_count=20, storage_options=options)
    config = StorageConfig(direct_get=direct_get, backoff_base=0.001, backoff_cap=0.01)
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

    def no_fetch(a, b, timeout=None):
        raise AssertionError("a streamed range makes no per-read request")

    return Fetcher("test", no_fetch, open_body)


def test_a_range_reader_reads_every_block_from_one_body_and_resumes_at_the_byte_reached():
    data = bytes(range(256)) * 400  # 102,400 bytes
    log: list = []
    read = make_range_reader(_fetcher(data, log), url="s3://b/k", start=100, end=90_000)
    out = b"".join(iter(lambda: bytes(read(7_000)), b""))
    assert out == data[100:90_000]
    assert [e for e in log if e[0] == "open"] == [("open", 100, 90_000)]
    assert log[-1] == ("close", 89_900)  # read to its end: closed (the connection serves the next request)

    log.clear()
    read = make_range_reader(
        _fetcher(data, log, cut_every=25_000), url="s3://b/k", start=0, end=len(data), config=StorageConfig(backoff_base=0, backoff_cap=0)
    )
    view = memoryview(bytearray(len(data)))
    got = 0
    while k := read.readinto(view[got:]):  # into the caller's buffer, as the parser fills a large member
        got += k
    assert bytes(view[:got]) == data
    assert [e[1] for e in log if e[0] == "open"] == [0, 25_000, 50_000, 75_000, 100_000]

    log.clear()
    read = make_range_reader(_fetcher(data, log), url="s3://b/k", start=0, end=len(data))
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
    from shardstream.storage.requests import count_requests

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
    from shardstream.storage.requests import S3_GETS_PER_PREFIX, count_requests

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
    assert "requests: 10 GETs per epoch" in summary and "busiest of 4 prefixes" in summary
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

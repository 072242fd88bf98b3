"""Every fenced ```python and ```bash block in README.md and docs/*.md runs as written, one test per
block (id ``FILE:LINE`` of its opening fence). New pages are picked up by the glob.

Which blocks run
    All of them, except a block whose fence has the line ``<!-- not run: REASON -->`` right above
    it: those are reported as skipped with their reason (keep them few, and the reasons true).

Where they run
    Each block runs on its own, in a fresh directory holding "the reader's world" (``build_world``,
    ``LOCAL_WORLD`` and ``S3_WORLD`` below): ``./shards`` (2,560 16x16 JPEGs in 10 classes, keys
    ``cat/0001`` ..., packed with labels), ``./train`` (an ImageFolder tree: 100 of those images),
    ``captions.jsonl`` (+ ``img/``), ``./table`` (a Parquet table: 4 files of 2,000 rows, columns
    ``id``, ``x``, ``label``, ``text``), ``corpus.jsonl`` (400 documents, ``{"id", "text"}``) with
    ``tokenizer.json`` trained on it and ``./tokens`` and ``./code-tokens`` (it, packed with that
    tokenizer), its token ids as ``./tokenized/train-0.parquet`` (an ``input_ids`` list<int32>
    column) and ``./npy-tokens/shard-0000.tar`` ... ``-0003.tar`` (webdataset, ``.npy``, no
    manifest), ``wds/train-000000.tar`` ... ``-000099.tar`` shards written by ``tarfile`` with
    ``./wds/index.json`` over them, and so on;
    ``examples/`` and ``benchmarks/`` link to the repository's. A moto S3 server (this module's
    own, reset before each block) holds the buckets the docs name: ``s3://bucket/train`` (the
    same dataset), ``s3://a/train``, ``s3://b/train``, ``s3://old/train-*.tar`` ... Blocks see it
    through the standard variables (``AWS_ENDPOINT_URL``, keys, a config file with the profiles
    the docs name), as a reader's S3 would be configured; shardstream reads no variable of its own.
    A block that writes a dataset (``shardstream pack SRC DEST``, ``index ... DEST``, ``merge
    DEST ...``, ``ShardWriter(DEST)``, ``pack(..., DEST)``) finds nothing at DEST, as a reader
    writing a new dataset would.

    A few fixed placeholders stand for the reader's own servers and are pointed at the local ones
    (``ADDRESSES``): the S3 endpoints the docs write out (``http://127.0.0.1:9000``, a local
    MinIO's default, and ``https://s3.example.com``) become the moto server's address, and
    ``/local/nvme/cache`` a directory in the block's own. ``https://data.example.com`` is a local web
    server over a copy of ``./shards`` (``train/``) that answers the Hub's API too, where
    ``HF_ENDPOINT`` points ``hf://datasets/org/name/...`` (the RangeServer of tests/test_http.py).

Python blocks
    A block runs as a script file, as ``__main__`` (so a script's ``if __name__ == "__main__":``
    part runs, and DataLoader workers started from a forkserver or spawn import it as they would).
    To save a torch import per block, a runner process imports torch and shardstream once and
    forks a child per block, which runs the file with ``runpy.run_path`` (like a forkserver;
    ``python FILE`` differs only in the time it takes).

    A *fragment* is a block that uses a name it does not define. It runs after the earlier python
    blocks of the same page that define the names it needs (and what those need, in turn), in one
    script, in page order. Names no earlier block defines come from ``PRELUDE``: the imports every
    page assumes (``shardstream``, ``torch``, ``json``, ``os``) and the parts of a training script
    that are the reader's own (``device`` = "cpu", ``epochs`` = 1, ``rank`` = 0, ``model``,
    ``optimizer``, a checkpoint ``path``/``tmp``, ``dataset`` over ``./shards``, an ``image``,
    ``my_data``, a decoder ``my_16bit_png``). A block that
    uses any other undefined name fails here: the page forgot to define it. A block that defines
    all it uses (a complete script) runs alone, without the prelude.

Bash blocks
    Run with ``bash -euo pipefail``, the venv's ``bin`` first on PATH (``shardstream``,
    ``python``, ``torchrun``), and this checkout on PYTHONPATH.

Everything is small (one epoch over a few thousand 16x16 images at most) so the whole file takes
well under a minute on a loaded 2-core machine.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port
from PIL import Image
from test_http import RangeServer

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>python|bash)\s*$")
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>.+?)\s*-->\s*$")
BLOCK_TIMEOUT_S = 240  # one block, generous for a loaded machine (they take a few seconds)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    not_run: str | None

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, indent = i, m["indent"]
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{page}:{start + 1}: a ```{m['lang']} fence that is never closed"
        code = textwrap.dedent("\n".join(body)) if indent else "\n".join(body)
        above = NOT_RUN.match(lines[start - 1]) if start > 0 else None
        found.append(Block(page, start + 1, m["lang"], code + "\n", above["reason"] if above else None))
        i += 1
    return found


BLOCKS = [b for page in PAGES for b in blocks_of(page)]


# -- what a python block defines and needs ---------------------------------------------------------
def defined_and_used(code: str) -> tuple[set[str], set[str]]:
    """(names the code binds anywhere, names it reads that it does not bind and are not builtins)."""
    tree = ast.parse(code)
    bound, used = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound, used - bound - set(dir(builtins))


# The reader's own parts of a training script, for fragments that use them without defining them.
PRELUDE = """\
import json
import os

import torch

import shardstream

device = "cpu"
epochs = 1
rank = 0
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(10))
model(torch.zeros(1, 3, 224, 224))  # the lazy layer takes its shape from the images the pages crop to
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
path, tmp = "checkpoint.pt", "checkpoint.pt.tmp"
image = torch.zeros(16, 16, 3, dtype=torch.uint8).numpy()  # a sample's image
my_data = [(image, i % 10) for i in range(100)]  # (image, label) pairs


def my_16bit_png(data):  # a decoder of the reader's
    import io

    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)))
dataset = shardstream.ShardStream("./shards", batch_size=64)
"""
PRELUDE_NAMES = defined_and_used(PRELUDE)[0]


def script_for(block: Block) -> str:
    """The block, or for a fragment: the prelude (if needed), the earlier blocks of its page that
    it needs, and the block, in page order."""
    bound, need = defined_and_used(block.code)
    if not need:
        return block.code
    earlier = [b for b in BLOCKS if b.page == block.page and b.lang == "python" and b.line < block.line and b.not_run is None]
    chosen: list[Block] = []
    for b in reversed(earlier):
        try:
            b_bound, b_need = defined_and_used(b.code)
        except SyntaxError:  # its own test says so
            continue
        if b_bound & need:
            chosen.insert(0, b)
            need = (need - b_bound) | b_need
    unknown = need - PRELUDE_NAMES
    assert not unknown, f"{block.id} uses {sorted(unknown)}, which no earlier block of its page defines"
    parts = [PRELUDE] if need else []
    parts += [f"# --- {b.id}\n{b.code}" for b in chosen] + [f"# --- {block.id}\n{block.code}"]
    return "\n".join(parts)


# -- where a block writes ---------------------------------------------------------------------------
def norm(url: str) -> str:
    url = url.rstrip("/")
    return url[2:] if url.startswith("./") else url


def destinations(block: Block) -> set[str]:
    """The datasets the block writes: the world leaves those places empty."""
    dests = set()
    if block.lang == "bash":
        text = block.code.replace("\\\n", " ")
        for line in text.splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            if len(words) < 3 or words[0] != "shardstream":
                continue
            command, args = words[1], [w for w in words[2:] if not w.startswith("-")]
            if command == "pack" and len(args) >= 2:
                dests.add(norm(args[1]))
            elif command == "index" and "--upgrade" not in words and len(args) >= 2:
                dests.add(norm(args[-1]))
            elif command == "merge" and args and args[0] not in args[1:]:
                dests.add(norm(args[0]))
    else:
        for node in ast.walk(ast.parse(block.code)):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if name == "ShardWriter" and strings:
                dests.add(norm(strings[0]))
            elif name in ("pack", "pack_tokens") and len(node.args) >= 2:
                last = node.args[-1]
                if isinstance(last, ast.Constant) and isinstance(last.value, str):
                    dests.add(norm(last.value))
    return dests


# -- the reader's world -------------------------------------------------------------------------------
CLASSES = ("cat", "dog", "bird", "fish", "frog", "horse", "ship", "truck", "car", "deer")
PER_CLASS = 256  # 2,560 samples: enough for the docs' batch_size=256 with num_workers=8


def _jpeg(rng: np.random.Generator, size: int = 16) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def _tar_shard(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for key, fields in samples:
            for ext, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _version_1(root: Path) -> None:
    """Rewrite a packed dataset's manifest in the old format (offsets inline, no sidecars)."""
    from shardstream import load_manifest

    m = load_manifest(str(root))
    doc = json.loads(m.dumps())
    doc["version"] = 1
    doc["shards"] = [
        {"path": m.paths[i], "samples": int(m.counts[i]), "bytes": int(m.sizes[i]), "sha256": m.sha256(i), "offsets": m.offsets(i).tolist()}
        for i in range(len(m.paths))
    ]
    (root / "index.json").write_text(json.dumps(doc))
    for idx in root.glob("*.idx"):
        idx.unlink()


def build_world(seed: Path) -> None:
    from shardstream import ShardWriter, pack

    rng = np.random.default_rng(0)
    images = [_jpeg(rng) for _ in range(16)]  # the tree's files take turns with these
    jpg = images[0]
    for c in CLASSES:  # ./shards is packed from 2,560 images; ./train, which blocks pack again, holds 100 of them
        (seed / "all-images" / c).mkdir(parents=True)
        (seed / "train" / c).mkdir(parents=True)
        for i in range(1, PER_CLASS + 1):
            (seed / "all-images" / c / f"{i:04d}.jpg").write_bytes(images[i % len(images)])
            if i <= 10:
                os.link(seed / "all-images" / c / f"{i:04d}.jpg", seed / "train" / c / f"{i:04d}.jpg")
    pack(str(seed / "all-images"), str(seed / "shards"), label_from_dir=True, max_count=1000)
    # a JSONL list of image-caption pairs
    lines = []
    for i in range(1, 65):
        (seed / "img").mkdir(exist_ok=True)
        (seed / "img" / f"a{i}.jpg").write_bytes(_jpeg(rng, 48))  # examples/train_jsonl_captions.py crops 32x32
        lines.append(json.dumps({"__key__": f"a{i}", "txt": f"caption {i}", "jpg": {"$file": f"img/a{i}.jpg"}, "cls": i % 10}))
    (seed / "captions.jsonl").write_text("\n".join(lines) + "\n")
    # shards written by others: 100 tar files of 1 sample each, and a manifest over them
    for i in range(100):
        _tar_shard(seed / "wds" / f"train-{i:06d}.tar", [(f"s{i:06d}", {"jpg": jpg, "cls": str(i % 10).encode()})])
    index = [sys.executable, "-m", "shardstream", "index", "wds/train-{000000..000099}.tar", "./wds"]
    subprocess.run(index, cwd=seed, check=True, env=_env(seed, ""), capture_output=True)

    # more shards from elsewhere, for `index`'s several kinds of input: directories, globs of
    # .tar and .tgz, and a file listing shard paths
    def samples(name: str) -> list[tuple[str, dict[str, bytes]]]:
        return [(f"{name}-{k}", {"jpg": jpg, "cls": b"1"}) for k in range(8)]

    for i in range(2):
        _tar_shard(seed / "downloads" / f"part-{i}.tar", samples(f"downloads{i}"))
        _tar_shard(seed / "a" / f"part-{i}.tar", samples(f"a{i}"))
        _tar_shard(seed / "extra" / f"part-{i}.tar", samples(f"extra{i}"))
        for folder in ("more", "b"):
            _tar_shard(seed / folder / f"part-{i}.tar", samples(f"{folder}{i}"))
            with open(seed / folder / f"part-{i}.tar", "rb") as src, open(seed / folder / f"part-{i}.tgz", "wb") as dst:
                dst.write(__import__("gzip").compress(src.read(), mtime=0))
            (seed / folder / f"part-{i}.tar").unlink()
    (seed / "urls.txt").write_text("".join(f"extra/part-{i}.tar\n" for i in range(2)))
    # small datasets packed one per day, a mix's third source, and a dataset with a version-1 manifest
    for name in ("days/day-01", "days/day-02", "days/day-03", "math", "old"):
        with ShardWriter(str(seed / name), max_count=100) as writer:
            for i in range(200):
                writer.write({"__key__": f"{name}/{i:04d}", "jpg": jpg, "cls": i % 10})
    _version_1(seed / "old")
    # a Parquet table: 4 files of 2,000 rows in row groups of 500 (id, a float feature, a caption)
    import pyarrow as pa
    import pyarrow.parquet as pq

    (seed / "table").mkdir()
    for f in range(4):
        ids = np.arange(f * 2000, (f + 1) * 2000)
        columns = {"id": ids, "x": rng.random(len(ids), dtype=np.float32), "label": ids % 10, "text": [f"row {i}" for i in ids]}
        pq.write_table(pa.table(columns), seed / "table" / f"part-{f}.parquet", row_group_size=500)
    # a text corpus, a tokenizer trained on it here (no download) and the corpus packed with it
    words = "the a river stone cloud night light model token data train step loss rank batch shard".split()
    texts = [" ".join(words[int(k)] for k in rng.integers(0, len(words), int(n))) for n in rng.integers(5, 120, 400)]
    (seed / "corpus.jsonl").write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"]))
    tokenizer.save(str(seed / "tokenizer.json"))
    from shardstream import pack_tokens

    for name in ("tokens", "code-tokens"):
        pack_tokens(str(seed / "corpus.jsonl"), str(seed / name), tokenizer=str(seed / "tokenizer.json"), eos=True, max_count=100)
    # the same documents' token ids written by others: a Parquet table (list<int32>, as Hugging Face
    # datasets write it) and webdataset tar shards of .npy arrays, with no manifest
    import webdataset

    ids = [tokenizer.encode(t).ids + [1] for t in texts]
    (seed / "tokenized").mkdir()
    pq.write_table(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32()))}), seed / "tokenized" / "train-0.parquet", row_group_size=100)
    (seed / "npy-tokens").mkdir()
    for k in range(4):
        with webdataset.TarWriter(str(seed / "npy-tokens" / f"shard-{k:04d}.tar")) as writer:
            for i in range(k * 100, (k + 1) * 100):
                writer.write({"__key__": f"doc{i:05d}", "npy": np.array(ids[i], dtype=np.int64)})


def _env(cwd: Path, s3: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PYTEST_", "COV_"))}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        HOME=str(cwd),
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=str(cwd / ".aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(cwd / ".aws-credentials"),
        GLOO_SOCKET_IFNAME="lo",
    )
    if s3:
        env["AWS_ENDPOINT_URL"] = s3
    return env


# S3 contents: a place <- (a folder of the seed, which of its files)
S3_WORLD = {
    "s3://bucket/train": ("shards", "*"),
    "s3://bucket/train/day-01": ("days/day-01", "*"),
    "s3://bucket/train/day-02": ("days/day-02", "*"),
    "s3://bucket/train/day-03": ("days/day-03", "*"),
    "s3://web/train": ("shards", "*"),
    "s3://curated/train": ("shards", "*"),
    "s3://old": ("wds", "train-0000[0-9][0-9].tar"),
    "s3://bucket/table": ("table", "*.parquet"),
}
LOCAL_WORLD = (
    "train",
    "shards",
    "img",
    "captions.jsonl",
    "wds",
    "downloads",
    "a",
    "b",
    "more",
    "urls.txt",
    "extra",
    "days",
    "math",
    "old",
    "table",
    "corpus.jsonl",
    "tokenizer.json",
    "tokens",
    "code-tokens",
    "tokenized",
    "npy-tokens",
)
# Folders whose contents are a block's input even where the block writes a manifest into them (shards
# written by others, which `index` indexes in place; `days`, whose parts `merge` combines): such a
# block finds them without a manifest of their own.
FOREIGN = ("wds", "downloads", "days", "table", "npy-tokens")
LOCAL_NEEDS = {"captions.jsonl": ("img",), "urls.txt": ("extra",)}  # files the named ones point to
ADDRESSES = ("http://127.0.0.1:9000", "https://s3.example.com")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(the seed folder, the moto endpoint, the web server's address, the runner)."""
    from moto.server import ThreadedMotoServer

    seed = tmp_path_factory.mktemp("docs-world")
    build_world(seed)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    shutil.copytree(seed / "shards", seed / "www" / "train")
    web = RangeServer(str(seed / "www"))  # a web server, and the Hub's API, over www/
    web.hub = True
    runner = Runner()
    try:
        yield seed, f"http://127.0.0.1:{port}", web.url, runner
    finally:
        runner.close()
        web.stop()
        server.stop()


def materialize(block: Block, seed: Path, cwd: Path, s3: str) -> None:
    text = block.code if block.lang == "bash" else script_for(block)
    dests = destinations(block)
    if block.lang == "python":  # and those of the earlier blocks a fragment runs after
        dests |= set().union(*(destinations(b) for b in BLOCKS if b.page == block.page and b is not block and b.code in text))
    named = {n for n in LOCAL_WORLD if re.search(rf"(?:(?<![\w/:.-])|(?<=[^.]\./)|(?<=^\./)){re.escape(n)}\b", text, re.M)}
    named |= {m for n in named for m in LOCAL_NEEDS.get(n, ())}
    for name in LOCAL_WORLD:
        if name not in named or (name in dests and name not in FOREIGN):
            continue
        src = seed / name
        if src.is_dir():
            top = str(src) if name in dests else None  # a FOREIGN folder the block writes a manifest into

            def manifest(folder: str, names: list[str], top: str | None = top) -> list[str]:
                return [n for n in names if folder == top and (n == "index.json" or n.endswith(".idx"))]

            shutil.copytree(src, cwd / name, copy_function=os.link, ignore=manifest)
        else:
            os.link(src, cwd / name)
    for name in ("examples", "benchmarks"):
        (cwd / name).symlink_to(REPO / name)
    profiles = ("training", "curated")  # the profiles the docs name
    (cwd / ".aws-config").write_text("".join(f"[profile {p}]\nregion = us-east-1\n" for p in profiles))
    (cwd / ".aws-credentials").write_text("".join(f"[{p}]\naws_access_key_id = testing\naws_secret_access_key = testing\n" for p in profiles))
    if "s3://" not in text:
        return
    import boto3

    urllib.request.urlopen(urllib.request.Request(f"{s3}/moto-api/reset", method="POST"), timeout=30).close()
    client = boto3.client("s3", endpoint_url=s3, region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing")
    buckets = set(re.findall(r"s3://([a-z0-9.-]+)", text)) & {url[5:].split("/")[0] for url in S3_WORLD}
    for bucket in sorted(buckets):
        client.create_bucket(Bucket=bucket)
    for url, (folder, pattern) in S3_WORLD.items():
        bucket, _, prefix = url[5:].partition("/")
        under = any(url.startswith(d + "/") for d in dests)  # under a place the block writes: only if named
        if bucket not in buckets or (url in dests and folder not in FOREIGN) or (under and url not in text):
            continue
        for f in sorted((seed / folder).glob(pattern)):
            client.upload_file(str(f), bucket, f"{prefix}/{f.name}" if prefix else f.name)


# -- running ----------------------------------------------------------------------------------------------
RUNNER = r"""
import json, os, runpy, signal, sys, time, traceback
import torch, numpy, PIL.Image, shardstream, shardstream.loader  # once, for every block
import s3fs, boto3, fsspec.implementations.http  # 0.3 s of each S3 block's CPU
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # imports torch._dynamo (2-3 s) here, not per block
shardstream.ShardStream, shardstream.make_loader, shardstream.ShardWriter  # the lazily imported parts

for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setpgrp()
            os.chdir(job["cwd"])
            os.environ.clear()
            os.environ.update(job["env"])
            out = os.open(job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(out, 1)
            os.dup2(out, 2)
            sys.argv = [job["script"]]
            sys.path[0] = job["cwd"]
            runpy.run_path(job["script"], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + job["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            rc = "timeout"
            break
        time.sleep(0.05)  # waitpid has no timeout; a block takes seconds
    try:
        os.killpg(pid, signal.SIGKILL)  # what the block left behind (a forkserver, workers)
    except ProcessLookupError:
        pass
    print(json.dumps({"rc": rc}), flush=True)
"""


class Runner:
    """A process that imported torch and shardstream once and forks a child per python block."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RUNNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(REPO, ""), cwd=REPO
        )

    def run(self, script: Path, cwd: Path, env: dict[str, str], out: Path) -> int | str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        job = {"script": str(script), "cwd": str(cwd), "env": env, "out": str(out), "timeout": BLOCK_TIMEOUT_S}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        assert reply, f"the runner process exited (code {self.proc.poll()}); its error is above"
        return json.loads(reply)["rc"]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def numbered(text: str) -> str:
    return "\n".join(f"{i:4d}  {line}" for i, line in enumerate(text.splitlines(), 1))


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 120)
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs_as_written(block: Block, world, tmp_path):
    if block.not_run:
        pytest.skip(f"not run: {block.not_run}")
    seed, s3, web, runner = world
    cwd = tmp_path / "work"
    cwd.mkdir()
    materialize(block, seed, cwd, s3)
    text = block.code if block.lang == "bash" else script_for(block)
    for address in ADDRESSES:
        text = text.replace(address, s3)
    text = text.replace("https://data.example.com", web).replace("/local/nvme/cache", str(cwd / "nvme-cache"))
    env = _env(cwd, s3)
    env.update(HF_ENDPOINT=web, HF_HOME=str(cwd / ".hf"))  # the Hub: this web server, no token of the user's
    out = tmp_path / "output.txt"
    if block.lang == "bash":
        script = tmp_path / "block.sh"
        script.write_text(text)
        with open(out, "w") as f:
            command = ["bash", "-euo", "pipefail", str(script)]
            bash = subprocess.Popen(command, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc: int | str = bash.wait(BLOCK_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                rc = "timeout"
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(bash.pid, signal.SIGKILL)  # what the block left behind (on a timeout: all of it)
                bash.wait()
    else:
        script = cwd / "docs_block.py"
        script.write_text(text)
        if text != block.code:  # a fragment: a part of the reader's script, whose guard it leaves out
            env["SHARDSTREAM_START_METHOD"] = "fork"  # (a forkserver worker would run it again, unguarded)
        rc = runner.run(script, cwd, env, out)
    output = out.read_text(errors="replace")
    assert rc == 0, f"{block.id} failed (exit {rc}):\n{numbered(text)}\n--- output (last 6000 characters):\n{output[-6000:]}"


OTHER_SPELLINGS = re.compile(r"^\s*```\s*(sh|shell|console|zsh|py|python3|pycon|ipython)\s*$")


def test_every_page_is_found_and_markers_sit_on_fences():
    """The glob finds the pages; a not-run marker is only ever right above a python/bash fence (a
    marker anywhere else would silently mark nothing); and no block hides from the run under
    another spelling of python or shell (```sh, ```py ...)."""
    assert REPO / "README.md" in PAGES and REPO / "docs" / "quickstart.md" in PAGES
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            where = f"{page.relative_to(REPO)}:{i + 1}"
            if NOT_RUN.match(line):
                assert i + 1 < len(lines) and FENCE.match(lines[i + 1]), f"{where}: a not-run marker not right above a fence"
            assert not OTHER_SPELLINGS.match(line), f"{where}: write ```bash or ```python (so the block runs here), or ```text"


RATIO = re.compile(r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?x\b")  # a speed-up: 1.9x, 1.63-1.81x


def section(text: str, start: str, end: str) -> str:
    i = text.index(start)
    j = text.find(end, i + len(start))
    return text[i : j if j >= 0 else len(text)]


def test_speedups_quoted_in_the_docs_are_those_of_benchmarks_current_figures():
    """One set of figures: every speed-up README.md, docs/index.md and docs/performance.md quote
    is in BENCHMARKS.md's "Current figures" table (the source of truth; a new measurement
    changes it there first)."""
    current = set(RATIO.findall(section((REPO / "BENCHMARKS.md").read_text(), "## Current figures", "\n# ")))
    quoted = {
        "README.md": section((REPO / "README.md").read_text(), "## Benchmarks", "\n## "),
        "docs/index.md": section((REPO / "docs" / "index.md").read_text(), "**Fast on small machines.**", "\n- "),
        "docs/performance.md": section((REPO / "docs" / "performance.md").read_text(), "## What the benchmarks say", "\n## "),
    }
    for name, text in quoted.items():
        ratios = RATIO.findall(text)
        assert ratios, f"{name} quotes no speed-up where it should"
        assert set(ratios) <= current, f"{name} quotes {sorted(set(ratios) - current)}, which BENCHMARKS.md's current figures do not give"

"""A forkserver worker over a dataset on S3 starts with the S3 client's modules already imported
(the server preloads them: loader/start.py's REMOTE_PRELOAD), and one over a local dataset without them. Each case
runs in a new interpreter, since the forkserver's preload list is fixed when its server starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import scaled, write_dataset

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import shardstream
    from probe import seen

    if __name__ == "__main__":
        store = shardstream.Store(options=json.loads(sys.argv[2]))
        dataset = shardstream.ShardStream(sys.argv[1], batch_size=4, world=shardstream.World(0, 1), store=store)
        loader = shardstream.make_loader(dataset, num_workers=1, workers="processes", worker_init_fn=seen, pin_memory=False)
        assert loader.start_method == "forkserver"
        assert sum(len(b["__key__"]) for b in loader) == 20
    """
)
PROBE = textwrap.dedent(
    """
    import json, os, sys

    def seen(worker_id):  # at a worker's start, before its first read
        with open(os.environ["PRELOAD_OUT"], "w") as f:
            json.dump({m: m in sys.modules for m in ("botocore.session", "obstore.store")}, f)
    """
)


def worker_modules(tmp_path, url: str, options: dict) -> dict:
    (tmp_path / "main.py").write_text(SCRIPT)
    (tmp_path / "probe.py").write_text(PROBE)
    out = tmp_path / "seen.json"
    env = {**os.environ, "PRELOAD_OUT": str(out), "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    env.pop("SHARDSTREAM_START_METHOD", None)
    subprocess.run([sys.executable, str(tmp_path / "main.py"), url, json.dumps(options)], env=env, check=True, timeout=scaled(120))
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_worker_over_s3_starts_with_the_s3_client_imported(tmp_path, s3):
    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/d", n=20, max_count=10, storage_options=options)
    assert worker_modules(tmp_path, url, options) == {"botocore.session": True, "obstore.store": True}


@pytest.mark.slow
def test_a_worker_over_local_shards_does_not_import_it(tmp_path):
    url = write_dataset(tmp_path / "d", n=20, max_count=10)
    assert worker_modules(tmp_path, url, {}) == {"botocore.session": False, "obstore.store": False}

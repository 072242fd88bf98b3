"""A forkserver worker over a dataset on S3 starts with the S3 client's modules already imported
(the server preloads them: REMOTE_PRELOAD), and one over a local dataset without them. Each case
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
        loader = shardstream.make_loader(dataset, num_workers=1, worker_init_fn=seen, pin_memory=False)
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


IMPORTS = textwrap.dedent(
    """
    import os, sys
    import shardstream

    ARGV = list(sys.argv)  # (scripts parse their arguments at the top level, too)
    with open(os.environ["IMPORTS_OUT"], "a") as f:  # each process that imports this script
        f.write(f"{__name__} {os.getpid()} {ARGV[-1]}\\n")

    def started(worker_id):
        with open(os.environ["IMPORTS_OUT"], "a") as f:
            f.write(f"worker {os.getpid()} {ARGV[-1]}\\n")

    def run():
        dataset = shardstream.ShardStream(sys.argv[1], batch_size=4, shuffle=False, world=shardstream.World(0, 1))
        loader = shardstream.make_loader(dataset, num_workers=2, worker_init_fn=started, pin_memory=False, persistent_workers=False)
        for _ in range(2):  # two passes: new workers each
            assert sum(len(b["__key__"]) for b in loader) == 20
    """
)


@pytest.mark.parametrize("guarded", [True, False])
def test_the_forkserver_imports_a_guarded_main_script_once_for_every_worker(tmp_path, guarded):
    """Workers started from the forkserver find the main script imported already (its server imported
    it once: loader/mainpreload.py) rather than each importing it, and the modules it imports, again.
    A script whose loader starts at its top level is never imported there (that would run it): the
    first pass refuses it, as before."""
    url = write_dataset(tmp_path / "d", n=20, max_count=5)
    script = tmp_path / "main.py"
    script.write_text(IMPORTS + ('\nif __name__ == "__main__":\n    run()\n' if guarded else "\nrun()\n"))
    out = tmp_path / "imports.txt"
    env = {**os.environ, "IMPORTS_OUT": str(out)}
    env.pop("SHARDSTREAM_START_METHOD", None)
    done = subprocess.run([sys.executable, str(script), url], env=env, timeout=scaled(120), capture_output=True, text=True)
    lines = [line.split() for line in out.read_text().splitlines()]
    workers = {pid for name, pid, _ in lines if name == "worker"}
    importers = [(name, pid) for name, pid, _ in lines if name != "worker"]
    assert all(argv == url for _, _, argv in lines)  # the script saw the rank's arguments wherever it ran
    if guarded:
        assert done.returncode == 0, done.stderr[-2000:]
        assert len(workers) == 4  # two passes of 2 workers
        assert [name for name, _ in importers] == ["__main__", "__mp_main__"]  # the main process, then the server
        assert not workers & {pid for _, pid in importers}
    else:
        assert done.returncode != 0 and "if __name__ == '__main__':" in done.stderr
        assert [name for name, _ in importers] == ["__main__"] and not workers


TREES = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, os.environ["SHARDSTREAM_TREE"])  # this process's shardstream: not the working directory's
    import shardstream

    def started(worker_id):
        import shardstream

        with open(os.environ["TREES_OUT"], "a") as f:
            f.write(f"worker {shardstream.__file__}\\n")

    if __name__ == "__main__":
        with open(os.environ["TREES_OUT"], "a") as f:
            f.write(f"main {shardstream.__file__}\\n")
        dataset = shardstream.ShardStream(sys.argv[1], batch_size=4, shuffle=False, world=shardstream.World(0, 1))
        loader = shardstream.make_loader(dataset, num_workers=2, worker_init_fn=started, pin_memory=False, start_method="forkserver")
        assert sum(len(b["__key__"]) for b in loader) == 20
    """
)


@pytest.mark.parametrize("other", ["working directory", "PYTHONPATH"])
def test_forkserver_workers_run_the_shardstream_the_process_imported_not_another_tree(tmp_path, other):
    """A script that imported shardstream from one tree (sys.path set at run time, as an installed copy
    or a benchmark's --baseline) while another tree's shardstream sits in the working directory, or
    on PYTHONPATH: its forkserver workers run the script's shardstream. The server is handed the
    script's sys.path, which Python < 3.12.8 / 3.13.1 ignores (gh-117378): its preload imported the
    other tree's, and every worker forked from it ran that code (private.start_forkserver)."""
    import shutil

    import shardstream

    here = os.path.dirname(os.path.dirname(os.path.abspath(shardstream.__file__)))  # the tree under test
    tree = tmp_path / "tree"
    shutil.copytree(os.path.join(here, "shardstream"), tree / "shardstream", ignore=shutil.ignore_patterns("__pycache__"))
    other_tree = tmp_path / "other"
    shutil.copytree(tree, other_tree)  # the same code, somewhere else
    (tmp_path / "bin").mkdir()
    script = tmp_path / "bin" / "main.py"
    script.write_text(TREES)
    url = write_dataset(tmp_path / "d", n=20, max_count=5)
    out = tmp_path / "trees.txt"
    env = {**os.environ, "TREES_OUT": str(out), "SHARDSTREAM_TREE": str(tree)}
    env.pop("SHARDSTREAM_START_METHOD", None)
    if other == "PYTHONPATH":
        env["PYTHONPATH"] = os.pathsep.join([str(other_tree), env.get("PYTHONPATH", "")])
        cwd = str(tmp_path)
    else:
        env.pop("PYTHONPATH", None)  # (the suite's: the tree under test) shardstream comes from SHARDSTREAM_TREE
        cwd = str(other_tree)
    done = subprocess.run([sys.executable, str(script), url], env=env, cwd=cwd, timeout=scaled(180), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split(" ", 1) for line in out.read_text().splitlines()]
    main = [path for who, path in lines if who == "main"]
    workers = [path for who, path in lines if who == "worker"]
    assert main == [str(tree / "shardstream" / "__init__.py")]
    assert workers == main * 2

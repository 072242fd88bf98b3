"""``python -m benchmarks.child MODULE FUNCTION CONFIG_JSON``: run ``benchmarks.MODULE.FUNCTION(config)``
in this (fresh) process and print its result as one JSON line, with the versions seen here."""

from __future__ import annotations

import importlib
import json
import sys

PRELOAD = {
    "shardstream": ("torch.utils.data", "shardstream", "shardstream.dataset", "shardstream.loader", "shardstream.write.pack"),
    "webdataset": ("torch.utils.data", "webdataset"),
    "litdata": ("torch.utils.data", "litdata"),
    "torch": ("torch.utils.data",),
    "polars": ("torch.utils.data", "polars"),
    "datasets": ("torch.utils.data", "datasets"),
    "pyarrow": ("torch.utils.data", "pyarrow.parquet"),
    "boto3": ("torch.utils.data", "boto3"),
    "obstore": ("torch.utils.data", "obstore"),
}


def preload(peer: str) -> None:
    for name in PRELOAD.get(peer, ()):
        importlib.import_module(name)


def main() -> None:
    module, function, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    from benchmarks.harness import versions

    if function == "measure":  # imports are not what a pass measures: made before its clock
        preload(config.get("peer", ""))
    result = getattr(importlib.import_module(f"benchmarks.{module}"), function)(config)
    if isinstance(result, dict) and function == "measure":
        result["versions"] = versions(config.get("peer", ""))
    sys.stdout.flush()
    print(json.dumps(result))


if __name__ == "__main__":
    main()

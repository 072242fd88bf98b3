"""``python -m benchmarks WORKLOAD ...`` and ``python -m benchmarks report FILE.jsonl``."""

from benchmarks.cli import main

main()

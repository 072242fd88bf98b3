"""One benchmark harness: ``python -m benchmarks WORKLOAD [--peer ...] [--repeats N] [--out FILE.jsonl]``
and ``python -m benchmarks report FILE.jsonl`` (see ``python -m benchmarks --help`` and BENCHMARKS.md).

Workloads: small, image, large, s3, tables, tokens, pack, first-batch, resume. Helpers kept as
modules: ``s3server`` (real S3-compatible servers), ``latency_proxy``, ``make_synthetic``,
``free_port``, ``install_s3server.sh``; ``gpu_check`` checks the GPU paths on a lent machine.
"""

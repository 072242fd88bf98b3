# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
DEMO_DIR ?= data/demo
EXTRAS := test,dask,lint,docs

.PHONY: install demo lint test matrix bench docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first, from TORCH_SPEC, and only where the venv has none: a loose torch requirement
# would otherwise pull a multi-GB CUDA build.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/python benchmarks/make_synthetic.py $(DEMO_DIR)/src --classes 10 --per-class 100 --size 32
	$(BIN)/shardstream pack $(DEMO_DIR)/src $(DEMO_DIR)/shards --label-from-dir --max-count 100 --shuffle --seed 0 --overwrite
	OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo $(BIN)/torchrun --nnodes 1 --nproc-per-node 2 \
	    --master-addr 127.0.0.1 --master-port $$($(BIN)/python benchmarks/free_port.py) \
	    examples/train_ddp.py $(DEMO_DIR)/shards --epochs 3 --batch-size 32 --workers 1

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# the way users run it: no OMP_NUM_THREADS (torch's own threads are there; DataLoader workers
# start from a forkserver unless a test asks for fork or spawn)
test: lint
	$(BIN)/python -m pytest -q -n auto --dist loadfile

# the smoke subset on the oldest and the newest (Python, torch) pyproject.toml claims (.ci/matrix;
# its torch floor is 2.5 on Python 3.11-3.12 and 2.6 on 3.13)
matrix:
	.ci/matrix

# the docs site (mkdocs.yml, docs/) into site/; --strict: a broken link or API reference fails
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# the harness (benchmarks/, python -m benchmarks --help): JSON lines into bench.jsonl, then its medians
bench: install
	OMP_NUM_THREADS=1 $(BIN)/python -m benchmarks pack --peer shardstream,webdataset --out bench.jsonl
	OMP_NUM_THREADS=1 $(BIN)/python -m benchmarks small --peer shardstream,webdataset,torch --out bench.jsonl
	OMP_NUM_THREADS=1 $(BIN)/python -m benchmarks image --peer shardstream,webdataset,torch --out bench.jsonl
	$(BIN)/python -m benchmarks report bench.jsonl --print

clean:
	rm -rf $(VENV) data .pytest_cache

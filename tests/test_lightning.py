"""ShardDataModule under a real PyTorch Lightning Trainer (CPU): Lightning leaves the loaders as
they are, the loader's epoch follows the trainer's, training resumes mid-epoch through Lightning's
own checkpoint with every sample exactly once over the interrupted and the resumed run (2 DDP ranks,
gloo, killed with SIGKILL after a checkpoint), and validation weighted by ``__valid__`` equals a
single-process run's. A Parquet table as train and val data, on 1 process and on 2 DDP ranks: its
columnar batches reach training_step, every row once per epoch, and the masked validation counts
each of the table's rows exactly once."""

from __future__ import annotations

import json
import os
import time

import pytest
from conftest import free_port, launch_phase, write_dataset

pl = pytest.importorskip("pytorch_lightning")

import torch  # noqa: E402

import shardstream  # noqa: E402
from shardstream.errors import ConfigError  # noqa: E402
from shardstream.lightning import ShardDataModule  # noqa: E402
from shardstream.loader import ShardLoader  # noqa: E402

N_TRAIN = 64  # 2 ranks * 4 per batch * 8 batches: drop mode drops nothing
N_VAL = 37  # not a multiple of 2 * 4: pad mode repeats 3


class Model(pl.LightningModule):
    """A linear layer on the label; writes the keys it trains on and its masked validation sums."""

    def __init__(self, out: str | None = None):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.out = out
        self.trained: list[list[str]] = []
        self.val = torch.zeros(2, dtype=torch.float64)
        self.val_results: list[list[float]] = []

    def _write(self, record: dict) -> None:
        if self.out is not None:
            with open(self.out, "a") as f:
                f.write(json.dumps(record) + "\n")

    def training_step(self, batch, batch_idx):
        self.trained.append(list(batch["__key__"]))
        self._write({"train": list(batch["__key__"]), "epoch": self.current_epoch})
        return self.layer(batch["cls"].float().unsqueeze(1)).pow(2).mean()

    def on_validation_epoch_start(self):
        self.val = torch.zeros(2, dtype=torch.float64)

    def validation_step(self, batch, batch_idx):
        valid = batch["__valid__"]
        self.val += torch.stack([(batch["cls"].double() * valid).sum(), valid.sum().double()])

    def on_validation_epoch_end(self):
        total = self.trainer.strategy.reduce(self.val.clone(), reduce_op="sum")
        self.val_results.append(total.tolist())
        self._write({"val": total.tolist()})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _trainer(**options) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **options,
    )


def _val_expected() -> list[float]:
    return [float(sum(i % 7 for i in range(N_VAL))), float(N_VAL)]


def test_single_process_fit_epochs_and_masked_validation(tmp_path):
    train = write_dataset(tmp_path / "train", n=N_TRAIN, max_count=16)
    val = write_dataset(tmp_path / "val", n=N_VAL, max_count=10)
    dm = ShardDataModule(train, val, batch_size=4, eval_batch_size=5, num_workers=1, shuffle=shardstream.Shuffle(16), seed=3)
    model = Model()
    trainer = _trainer(devices=1, max_epochs=2)
    trainer.fit(model, dm)
    assert trainer.train_dataloader is not None and isinstance(trainer.train_dataloader, ShardLoader)  # not replaced
    per_epoch = len(model.trained) // 2
    assert per_epoch == N_TRAIN // 4
    epochs = [sorted(k for b in model.trained[e * per_epoch : (e + 1) * per_epoch] for k in b) for e in (0, 1)]
    assert epochs[0] == epochs[1] == [f"s{i:06d}" for i in range(N_TRAIN)]
    assert model.trained[:per_epoch] != model.trained[per_epoch:]  # epoch 1 is another shuffle: the trainer's epoch reached the loader
    assert dm.stream("train").epoch == 1
    assert model.val_results == [_val_expected(), _val_expected()]


def test_options_that_cannot_work_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="mode='pad'"):
        ShardDataModule("x", batch_size=4, eval_options={"mode": "drop"})
    with pytest.raises(ConfigError, match="batch_size"):
        ShardDataModule("x", batch_size=4, world=shardstream.World(0, 1))
    dm = ShardDataModule(val="x", batch_size=4)
    with pytest.raises(ConfigError, match="no train data"):
        dm.train_dataloader()


class Crash(pl.Callback):
    """After ``step`` optimizer steps: a checkpoint through Lightning, then wait to be killed."""

    def __init__(self, step: int, path: str, ready, rank: int):
        self.step, self.path, self.ready, self.rank = step, path, ready, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)  # every rank calls it; rank 0 writes
            self.ready.put(self.rank)
            while True:
                time.sleep(1)


def _rank_env(rank: int, world: int, port: int, work: str, phase: str) -> str:
    """A rank's environment as Lightning's DDP reads it; returns the (new, empty) file it records to."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        GLOO_SOCKET_IFNAME="lo",
    )
    torch.set_num_threads(1)
    out = os.path.join(work, f"{phase}.keys.{rank}")
    open(out, "w").close()
    return out


def _rank_main(rank: int, world: int, store: str, port: int, train: str, val: str, work: str, phase: str, ready) -> None:
    out = _rank_env(rank, world, port, work, phase)
    ckpt = os.path.join(work, "step.ckpt")
    dm = ShardDataModule(train, val, batch_size=4, num_workers=1, shuffle=shardstream.Shuffle(16), seed=11)
    callbacks = [Crash(3, ckpt, ready, rank)] if phase == "crash" else []
    trainer = _trainer(devices=world, strategy="ddp", max_epochs=1, callbacks=callbacks)
    trainer.fit(Model(out), dm, ckpt_path=ckpt if phase == "resume" else None)
    with open(out, "a") as f:  # under DDP too, Lightning kept our loaders (no DistributedSampler put in)
        f.write(json.dumps({"loaders": [type(trainer.train_dataloader).__name__, type(trainer.val_dataloaders).__name__]}) + "\n")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_kill_mid_epoch_resume_from_lightning_checkpoint(tmp_path):
    train = write_dataset(tmp_path / "train", n=N_TRAIN, max_count=16)
    val = write_dataset(tmp_path / "val", n=N_VAL, max_count=10)
    work = str(tmp_path)
    before = launch_phase(_rank_main, 2, work, "crash", (free_port(), train, val))
    saved = torch.load(tmp_path / "step.ckpt", weights_only=False)
    (state,) = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]  # the loader's position, saved by Lightning
    assert state["epoch"] == 0 and state["segments"][-1]["batches"] == 3 and state["segments"][-1]["world_size"] == 2
    after = launch_phase(_rank_main, 2, work, "resume", (free_port(), train, val))
    trained = [k for rank in (*before, *after) for rec in rank if "train" in rec for k in rec["train"]]
    assert [sum(1 for rec in rank if "train" in rec) for rank in before] == [3, 3]  # killed after 3 steps
    assert [sum(1 for rec in rank if "train" in rec) for rank in after] == [5, 5]  # the rest of the epoch
    assert sorted(trained) == [f"s{i:06d}" for i in range(N_TRAIN)]  # every sample exactly once
    assert [rec["loaders"] for rank in after for rec in rank if "loaders" in rec] == [["ShardLoader", "ShardLoader"]] * 2
    vals = [rec["val"] for rank in after for rec in rank if "val" in rec]
    single = _single_process_validation(val)
    assert vals == [single, single] and single == _val_expected()


def _single_process_validation(val: str) -> list[float]:
    model = Model()
    _trainer(devices=1).validate(model, ShardDataModule(val=val, batch_size=4, num_workers=0), verbose=False)
    (result,) = model.val_results
    return result


# -- a Parquet table as the train and val data ----------------------------------------------------
TABLE_TRAIN = (40, 24)  # 64 rows: 4 per batch, 16 batches on 1 rank, 8 on 2
TABLE_VAL = (20, 17)  # 37 rows: batches of 5 repeat 3 on 1 rank, of 4 on 2 ranks repeat 3


class TableModel(pl.LightningModule):
    """A linear layer on the ``x`` column; keeps the ids it trains on and the ids its masked
    validation counts (``__valid__``: False for pad mode's repeats), written too when ``out``."""

    def __init__(self, out: str | None = None):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.out = out
        self.trained: list[list[int]] = []
        self.validated: list[list[int]] = []
        self.repeats = 0

    def _write(self, record: dict) -> None:
        if self.out is not None:
            with open(self.out, "a") as f:
                f.write(json.dumps(record) + "\n")

    def training_step(self, batch, batch_idx):
        assert set(batch) == {"id", "x"} and batch["x"].dtype == torch.float32  # the projected columns, as tensors
        assert torch.equal(batch["x"], batch["id"].float() * 0.5)
        self.trained.append(batch["id"].tolist())
        self._write({"train": batch["id"].tolist(), "epoch": self.current_epoch})
        return self.layer(batch["x"].unsqueeze(1)).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        valid = batch["__valid__"]
        assert valid.dtype == torch.bool and len(valid) == len(batch["id"])
        self.validated.append(batch["id"][valid].tolist())
        self.repeats += int((~valid).sum())
        self._write({"val": batch["id"][valid].tolist(), "repeats": int((~valid).sum()), "epoch": self.current_epoch})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _table(root, rows) -> str:
    from test_parquet import write_table

    return write_table(root, rows=rows, group=8)


def _table_ids(root: str) -> list[int]:
    import pyarrow.parquet as pq

    return sorted(pq.read_table(root, columns=["id"]).column("id").to_pylist())


def test_single_process_fit_over_a_parquet_table(tmp_path):
    train = _table(tmp_path / "train", TABLE_TRAIN)
    val = _table(tmp_path / "val", TABLE_VAL)
    dm = ShardDataModule(
        shardstream.Table(train, columns=["id", "x"]),
        shardstream.Table(val, columns=["id", "x"]),
        batch_size=4,
        eval_batch_size=5,
        num_workers=1,
        shuffle=shardstream.Shuffle(16),
        seed=3,
    )
    model = TableModel()
    trainer = _trainer(devices=1, max_epochs=2)
    trainer.fit(model, dm)
    assert isinstance(trainer.train_dataloader, ShardLoader) and isinstance(trainer.val_dataloaders, ShardLoader)
    per_epoch = len(model.trained) // 2
    assert len(model.trained) == 2 * per_epoch and per_epoch == sum(TABLE_TRAIN) // 4
    epochs = [sorted(i for b in model.trained[e * per_epoch : (e + 1) * per_epoch] for i in b) for e in (0, 1)]
    assert epochs[0] == epochs[1] == _table_ids(train)  # every row once per epoch
    assert model.trained[:per_epoch] != model.trained[per_epoch:]  # another shuffle: the trainer's epoch reached the loader
    # Validation ran after each epoch: every validation row counted exactly once per run, the
    # repeats that filled the last batch masked out.
    counted = sorted(i for b in model.validated for i in b)
    assert counted == sorted(_table_ids(val) * 2)
    assert model.repeats == 2 * (-sum(TABLE_VAL) % 5) > 0


def _table_rank_main(rank: int, world: int, store: str, port: int, train: str, val: str, work: str, phase: str, ready) -> None:
    out = _rank_env(rank, world, port, work, phase)
    tables = [shardstream.Table(t, columns=["id", "x"]) for t in (train, val)]
    dm = ShardDataModule(*tables, batch_size=4, num_workers=1, shuffle=shardstream.Shuffle(16), seed=11)
    _trainer(devices=world, strategy="ddp", max_epochs=1).fit(TableModel(out), dm)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_fit_over_a_parquet_table(tmp_path):
    train = _table(tmp_path / "train", TABLE_TRAIN)
    val = _table(tmp_path / "val", TABLE_VAL)
    ranks = launch_phase(_table_rank_main, 2, str(tmp_path), "fit", (free_port(), train, val))
    trained = [[rec["train"] for rec in rank if "train" in rec] for rank in ranks]
    assert [len(t) for t in trained] == [sum(TABLE_TRAIN) // 8] * 2  # equal batches on both ranks
    assert sorted(i for t in trained for b in t for i in b) == _table_ids(train)  # every row once across ranks
    validated = [[rec for rec in rank if "val" in rec] for rank in ranks]
    assert len(validated[0]) == len(validated[1])  # pad mode: the same number of batches on every rank
    assert sorted(i for v in validated for rec in v for i in rec["val"]) == _table_ids(val)  # each row counted once
    assert sum(rec["repeats"] for v in validated for rec in v) == -sum(TABLE_VAL) % 8 > 0


# -- a user's own LightningDataModule returning a plain make_loader ---------------------------------
class PlainData(pl.LightningDataModule):
    """How a user writes it: a LightningDataModule whose train_dataloader returns make_loader's loader."""

    def __init__(self, root: str):
        super().__init__()
        self.root = root

    def train_dataloader(self):
        stream = shardstream.ShardStream(self.root, batch_size=4, shuffle=shardstream.Shuffle(16), seed=11)
        return shardstream.make_loader(stream, num_workers=1)


def _plain_rank_main(rank: int, world: int, store: str, port: int, train: str, work: str, phase: str, ready) -> None:
    out = _rank_env(rank, world, port, work, phase)
    ckpt = os.path.join(work, "step.ckpt")
    callbacks = [Crash(3, ckpt, ready, rank)] if phase == "crash" else []
    trainer = _trainer(devices=world, strategy="ddp", max_epochs=1, callbacks=callbacks, limit_val_batches=0)
    trainer.fit(Model(out), PlainData(train), ckpt_path=ckpt if phase == "resume" else None)
    with open(out, "a") as f:
        f.write(json.dumps({"len": len(trainer.train_dataloader), "batches": trainer.num_training_batches}) + "\n")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_plain_make_loader_datamodule_resumes_every_sample_once(tmp_path):
    # Lightning reads len(loader) before it loads the loader's state, ends the epoch at it and
    # restores its own count of the batches done: len must be the whole pass after a resume too.
    train = write_dataset(tmp_path / "train", n=N_TRAIN, max_count=16)
    work = str(tmp_path)
    before = launch_phase(_plain_rank_main, 2, work, "crash", (free_port(), train))
    after = launch_phase(_plain_rank_main, 2, work, "resume", (free_port(), train))
    assert [sum(1 for rec in rank if "train" in rec) for rank in before] == [3, 3]
    assert [sum(1 for rec in rank if "train" in rec) for rank in after] == [5, 5]  # the rest of the epoch
    trained = [k for rank in (*before, *after) for rec in rank if "train" in rec for k in rec["train"]]
    assert sorted(trained) == [f"s{i:06d}" for i in range(N_TRAIN)]  # every sample exactly once
    assert [rec for rank in after for rec in rank if "len" in rec] == [{"len": 8, "batches": 8}] * 2  # the whole pass


# -- ShardDataModule resumed on another number of ranks ---------------------------------------------
def _elastic_rank_main(rank: int, world: int, store: str, port: int, train: str, val: str, step: int, work: str, phase: str, ready) -> None:
    out = _rank_env(rank, world, port, work, phase)
    ckpt = os.path.join(work, "step.ckpt")
    dm = ShardDataModule(train, val, batch_size=4, num_workers=1, shuffle=shardstream.Shuffle(16), seed=11)
    callbacks = [Crash(step, ckpt, ready, rank)] if phase == "crash" else []
    trainer = _trainer(devices=world, strategy="ddp", max_epochs=1, callbacks=callbacks)
    trainer.fit(Model(out), dm, ckpt_path=ckpt if phase == "resume" else None)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("old,new,step,rest", [(1, 2, 4, 6), (2, 1, 3, 10)])
def test_ddp_datamodule_resumes_elastically_with_validation(tmp_path, old, new, step, rest):
    # 1 -> 2: 16 batches on 1 rank, 4 done, the other 48 samples in 6 batches per rank;
    # 2 -> 1: 8 batches per rank, 3 done (24 samples), the other 40 in 10 batches on 1 rank.
    train = write_dataset(tmp_path / "train", n=N_TRAIN, max_count=16)
    val = write_dataset(tmp_path / "val", n=N_VAL, max_count=10)
    work = str(tmp_path)
    before = launch_phase(_elastic_rank_main, old, work, "crash", (free_port(), train, val, step))
    saved = torch.load(tmp_path / "step.ckpt", weights_only=False)
    assert saved["ShardDataModule"]["counted"] == step  # the datamodule's own copy of the position
    after = launch_phase(_elastic_rank_main, new, work, "resume", (free_port(), train, val, step))
    assert [sum(1 for rec in rank if "train" in rec) for rank in before] == [step] * old
    assert [sum(1 for rec in rank if "train" in rec) for rank in after] == [rest] * new
    trained = [k for rank in (*before, *after) for rec in rank if "train" in rec for k in rec["train"]]
    assert sorted(trained) == [f"s{i:06d}" for i in range(N_TRAIN)]  # every unseen sample, once
    assert [rec["val"] for rank in after for rec in rank if "val" in rec] == [_val_expected()] * new  # validation ran


# -- train-only modules, and both Lightning packages -------------------------------------------------
def test_train_only_module_skips_validation_like_lightning(tmp_path):
    train = write_dataset(tmp_path / "train", n=N_TRAIN, max_count=16)
    model = Model()  # it has validation_step; Lightning skips validation without val data
    _trainer(devices=1, max_epochs=1, limit_val_batches=1.0).fit(model, ShardDataModule(train, batch_size=8, num_workers=0))
    assert sorted(k for b in model.trained for k in b) == [f"s{i:06d}" for i in range(N_TRAIN)]
    assert model.val_results == []


def test_both_lightning_packages_take_the_module(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    train = write_dataset(tmp_path / "train", n=N_TRAIN, max_count=16)
    val = write_dataset(tmp_path / "val", n=N_VAL, max_count=10)
    dm = ShardDataModule(train, val, batch_size=4, num_workers=0)
    assert isinstance(dm, L.LightningDataModule) and isinstance(dm, pl.LightningDataModule)

    class LModel(L.LightningModule):  # the same model, as a lightning.pytorch module
        training_step = Model.training_step
        validation_step = Model.validation_step
        on_validation_epoch_start = Model.on_validation_epoch_start
        on_validation_epoch_end = Model.on_validation_epoch_end
        configure_optimizers = Model.configure_optimizers
        _write = Model._write

        def __init__(self):
            super().__init__()
            self.layer, self.out, self.trained, self.val_results = torch.nn.Linear(1, 1), None, [], []

    model = LModel()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, dm)
    assert sorted(k for b in model.trained for k in b) == [f"s{i:06d}" for i in range(N_TRAIN)]
    assert model.val_results == [_val_expected()]

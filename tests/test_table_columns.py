"""A table's columns are read as themselves or refused in one typed line: a name twice in the
schema or a reserved name (``__key__``, ``__valid__``, ...) is a SourceError naming the column,
with a per-sample transform or without, read or packed; an integer a batch cannot hold is a
SampleError naming the column and the row; a malformed ``hf://`` URL is a ConfigError giving
the expected form."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardstream import ShardStream, World
from shardstream.errors import ConfigError, SampleError, SourceError
from shardstream.format.parquet import Table
from shardstream.write.pack import pack


def same(row):
    return row  # a per-sample transform: the per-row path


def _write(path, names, arrays) -> str:
    pq.write_table(pa.Table.from_arrays(arrays, names=names), str(path), row_group_size=4)
    return str(path)


def _first(url, transform=None, columns=None):
    return next(iter(ShardStream(Table(url, columns=columns), batch_size=4, world=World(0, 1), shuffle=False, transform=transform)))


@pytest.mark.parametrize("transform", [None, same], ids=["columnar", "per-row"])
@pytest.mark.parametrize("name", ["dup", "__valid__", "__key__", "__present__", "__url__"])
def test_a_duplicate_or_reserved_column_is_one_source_error_naming_it(tmp_path, name, transform):
    ids = pa.array(np.arange(8), pa.int64())
    other = pa.array(np.arange(8) * 10, pa.int64())
    names = ["id", "dup", "dup"] if name == "dup" else ["id", name]
    url = _write(tmp_path / "t.parquet", names, [ids, other, other][: len(names)])
    with pytest.raises(SourceError, match=rf"t\.parquet: column '{name}' (appears 2 times|has a reserved name)") as info:
        _first(url, transform)
    assert "\n" not in str(info.value)
    # a projection that leaves the column out reads as before
    assert _first(url, transform, columns=["id"])["id"].tolist() == [0, 1, 2, 3]
    # pack says the same
    with pytest.raises(SourceError, match=rf"t\.parquet: column '{name}'"):
        pack(url, str(tmp_path / "packed"))


def test_a_uint64_above_int64_under_a_per_row_transform_is_a_sample_error_naming_column_and_row(tmp_path):
    big = pa.array([1, 2, 3, 2**63, 5, 6, 7, 2**64 - 1], pa.uint64())
    url = _write(tmp_path / "u.parquet", ["id", "big"], [pa.array(np.arange(8), pa.int64()), big])
    assert _first(url)["big"].tolist() == [1, 2, 3, 2**63]  # columnar: uint64 as it is
    with pytest.raises(SampleError, match=r"u\.parquet, sample '.*u\.parquet:3': field 'big': integer 9223372036854775808 does not fit in int64"):
        _first(url, same)


@pytest.mark.parametrize(
    "url",
    [
        "hf://datasets/index.json",
        "hf://datasets/",
        "hf://datasets",
        "hf://datasets/org",
        "hf://datasets/org/",
        "hf://models/org/name",
        "hf://models/x",
        "hf://spaces/org/name",
        "hf://",
        "hf://org/name",
        "hf://datasets//name",
        "hf://datasets/org/../name",
        "hf://datasets/org/name/../../other/x",
    ],
)
def test_a_malformed_hf_url_is_a_config_error_giving_the_expected_form(url, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing leaves the machine
    with pytest.raises(ConfigError, match=r"is not a Hugging Face dataset URL: the expected form is hf://datasets/ORG/NAME\[/path\]"):
        ShardStream(url, batch_size=4, world=World(0, 1))
    with pytest.raises(ConfigError, match=r"expected form is hf://datasets/ORG/NAME"):
        pack(url, str(tmp_path / "out"))

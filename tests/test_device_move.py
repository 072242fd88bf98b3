"""to_device / move_to rebuild every container a batch may be (dicts, lists, tuples,
namedtuples, nested) with each tensor moved, and leave everything else alone. Proven on torch's
"meta" device: a tensor there has no data, so a tensor that was not moved stays visibly on the CPU."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import numpy as np
import torch

from shardstream import to_device
from shardstream.device import move_to

Pair = namedtuple("Pair", ["image", "label"])
META = torch.device("meta")


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _batch():
    array = np.arange(3)
    return {
        "pair": Pair(torch.ones(2, 2), torch.tensor([1, 2])),
        "list_of_dicts": [{"a": torch.zeros(3)}, {"a": torch.zeros(3), "name": "x"}],
        "tuple": (torch.ones(1), "keep", 7),
        "nested": OrderedDict(inner=[Pair(torch.ones(1), [torch.ones(1)])]),
        "__key__": ["k0", "k1"],
        "raw": b"bytes",
        "array": array,
        "none": None,
    }


def test_every_tensor_at_any_depth_moves_and_containers_keep_their_types():
    batch = _batch()
    moved = move_to(batch, META)
    assert sum(1 for _ in _tensors(batch)) == 7
    assert all(t.device.type == "meta" for t in _tensors(moved)), [t.device for t in _tensors(moved)]
    assert sum(1 for _ in _tensors(moved)) == 7
    assert type(moved["pair"]) is Pair and moved["pair"].label.shape == (2,)
    assert type(moved["list_of_dicts"]) is list and moved["list_of_dicts"][1]["name"] == "x"
    assert type(moved["tuple"]) is tuple and moved["tuple"][1:] == ("keep", 7)
    assert type(moved["nested"]) is OrderedDict and type(moved["nested"]["inner"][0]) is Pair
    assert type(moved["nested"]["inner"][0].label) is list and moved["nested"]["inner"][0].label[0].device.type == "meta"
    assert moved["__key__"] is batch["__key__"]  # no tensor inside: the same object
    assert moved["raw"] is batch["raw"] and moved["array"] is batch["array"] and moved["none"] is None
    assert all(t.device.type == "cpu" for t in _tensors(batch))  # the input is not changed


def test_a_bare_namedtuple_and_a_bare_list_of_dicts_move():
    pair = move_to(Pair(torch.ones(1), 3), META)
    assert type(pair) is Pair and pair.image.device.type == "meta" and pair.label == 3
    rows = move_to([{"x": torch.ones(1)}, {"x": torch.ones(1)}], META)
    assert [r["x"].device.type for r in rows] == ["meta", "meta"]


def test_to_device_moves_namedtuple_batches_a_loader_yields():
    batches = [Pair(torch.full((2,), float(i)), [{"y": torch.tensor(i)}]) for i in range(3)]
    out = list(to_device(batches, META))
    assert len(out) == 3
    for b in out:
        assert type(b) is Pair and b.image.device.type == "meta" and b[1][0]["y"].device.type == "meta"
    ahead = list(to_device(batches, META, copy_ahead=1))  # the copy-ahead path moves the same way
    assert [type(b) for b in ahead] == [Pair] * 3 and all(t.device.type == "meta" for b in ahead for t in _tensors(b))

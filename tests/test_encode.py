"""write/encode.py: fields encode by extension and decode back to what went in; misfits are errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardstream.errors import SourceError
from shardstream.pipeline.decode import Decoder, default_decoders
from shardstream.write.encode import encode_sample, encode_value


def test_fields_round_trip_through_the_default_decoders():
    image = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    sample = {
        "__key__": "a/b",
        "txt": "héllo",
        "cls": 7,
        "json": {"b": [1, 2], "a": None},
        "npy": np.eye(3, dtype=np.float32),
        "pth": torch.tensor([1, 2]),
        "png": image,
        "bin": b"\x00\x01",
        "_meta": "dropped",
    }
    key, fields = encode_sample(sample)
    assert key == "a/b" and "_meta" not in fields and fields["bin"] == b"\x00\x01"
    decoded = Decoder(default_decoders())({**fields, "__key__": key})
    assert decoded["txt"] == "héllo" and decoded["cls"] == 7 and decoded["json"] == {"a": None, "b": [1, 2]}
    assert torch.equal(decoded["npy"], torch.eye(3)) and torch.equal(decoded["pth"], torch.tensor([1, 2]))
    assert torch.equal(decoded["png"], torch.from_numpy(image).permute(2, 0, 1))  # PNG is lossless
    assert decoded["bin"] == b"\x00\x01"


def test_json_is_canonical_so_packs_are_byte_identical():
    assert encode_value("json", {"b": 1, "a": 2}) == encode_value("json", {"a": 2, "b": 1}) == b'{"a":2,"b":1}'


def test_multi_part_extensions_encode_by_their_last_part():
    assert encode_value("seg.cls", 3) == b"3"


@pytest.mark.parametrize(
    "ext,value,message",
    [
        ("bin", 5, "give bytes or str"),
        ("cls", True, "give bytes or str"),
        ("jpg", np.zeros((2, 2, 3), dtype=np.float32), "uint8"),
        ("png", [1, 2], "cannot encode list as an image"),
    ],
)
def test_values_that_do_not_fit_name_the_extension(ext, value, message):
    with pytest.raises(TypeError, match=message):
        encode_value(ext, value)


@pytest.mark.parametrize(
    "sample,message",
    [
        (["not", "a", "dict"], "must be a dict"),
        ({"txt": "x"}, "no '__key__'"),
        ({"__key__": "a.b", "txt": "x"}, "not usable"),
        ({"__key__": "../a", "txt": "x"}, "not usable"),
        ({"__key__": "a", "TXT": "x"}, "lower-case extension"),
        ({"__key__": "a"}, "has no fields"),
        ({"__key__": "a", "bin": 5}, "key 'a', field 'bin'"),
    ],
)
def test_bad_samples_are_source_errors_naming_what(sample, message):
    with pytest.raises(SourceError, match=message):
        encode_sample(sample, where="line 3")

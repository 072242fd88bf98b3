"""Mixes of unlike datasets (issue #32): an image set (jpg, cls) and a caption set (jpg, cls,
json, txt, emb.npy) packed for real and read through make_loader with 0 and 2 DataLoader workers.

Batches of samples from both hold the union of their fields (None / zeros where missing, and a
presence mask), a per-source transform maps one source only, an ImageFolder of .jpg, .png and
.webp files trains as one ``image`` field with ``Decode(alias=...)``, and a resumed pass over
such a mix equals the uninterrupted one.
"""

from __future__ import annotations

import functools
import json
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from shardstream import ConfigError, Decode, SampleError, Schedule, ShardStream, Shuffle, Source, World, make_loader, pack
from shardstream.pipeline.batch import PRESENT, default_collate, present

IMAGE_KEYS = [f"class_{c}/{i:04d}" for c in range(3) for i in range(4)]  # 12 samples: jpg, cls
CAPTION_KEYS = [f"class_{c}/{i:04d}" for c in range(2) for i in range(6)]  # 12 samples: jpg, cls, json, txt, emb.npy


def _image(rng, size=16):
    return Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))


def write_sets(root):
    """Pack the two unlike sets; returns their dataset roots."""
    rng = np.random.default_rng(0)
    for key in IMAGE_KEYS:
        path = root / "images" / f"{key}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        _image(rng).save(path)
    for n, key in enumerate(CAPTION_KEYS):
        base = root / "captions" / key
        base.parent.mkdir(parents=True, exist_ok=True)
        _image(rng).save(f"{base}.jpg")
        (base.parent / f"{base.name}.json").write_text(json.dumps({"n": n}))
        (base.parent / f"{base.name}.txt").write_text(f"caption {n}")
        np.save(base.parent / f"{base.name}.emb.npy", np.full(4, n + 1, np.float32))
    pack(str(root / "images"), str(root / "img"), label_from_dir=True, max_count=5)
    pack(str(root / "captions"), str(root / "cap"), label_from_dir=True, max_count=5)
    return str(root / "img"), str(root / "cap")


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    return write_sets(tmp_path_factory.mktemp("unlike"))


def mix_of(sets, **img_options):
    img, cap = sets
    return [Source(img, name="img", **img_options), Source(cap, name="cap")]


def rows(batches):
    """Every sample of the batches as (source, key, its position's fields)."""
    out = []
    for b in batches:
        for i, (source, key) in enumerate(zip(b["__source__"], b["__key__"])):
            out.append((source, key, {name: present(b, name)[i].item() for name in ("jpg", "cls", "json", "txt", "emb.npy")}, b, i))
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mix_of_unlike_sets_batches_the_union_of_their_fields_with_masks(sets, workers):
    ds = ShardStream(mix_of(sets), batch_size=4, seed=3, shuffle=Shuffle(8), world=World(0, 1))
    batches = list(make_loader(ds, num_workers=workers, log_interval=None, pin_memory=False))
    assert len(batches) == 6
    seen = [(source, key) for source, key, *_ in rows(batches)]
    assert sorted(seen) == sorted([("img", k) for k in IMAGE_KEYS] + [("cap", k) for k in CAPTION_KEYS])  # every sample once
    unlike = 0
    for source, key, has, b, i in rows(batches):
        assert has["jpg"] and has["cls"] and b["jpg"].shape == (4, 3, 16, 16) and b["cls"].dtype == torch.int64
        if source == "cap":
            n = CAPTION_KEYS.index(key)
            assert has["json"] and has["txt"] and has["emb.npy"]
            assert b["json"][i] == {"n": n} and b["txt"][i] == f"caption {n}"
            assert torch.equal(b["emb.npy"][i], torch.full((4,), n + 1.0))
        else:
            assert not (has["json"] or has["txt"] or has["emb.npy"])
            if "txt" in b:  # the batch holds caption samples too: list fields None here, tensors zeros
                assert b["json"][i] is None and b["txt"][i] is None and torch.equal(b["emb.npy"][i], torch.zeros(4))
        if "txt" in b and "img" in b["__source__"]:
            unlike += 1
            assert set(b[PRESENT]) == {"json", "txt", "emb.npy"}  # a mask for each field some samples lack, no other
            assert b[PRESENT]["txt"].dtype == torch.bool and b["emb.npy"].dtype == torch.float32
    assert unlike >= 4  # most batches hold both sources (spread: every batch close to the shares)


def test_samples_of_one_source_that_differ_are_still_an_error_but_union_on_request(tmp_path):
    """A single dataset whose samples lack a field is a data error (the default); missing='union' batches it."""
    from shardstream import ShardWriter

    with ShardWriter(str(tmp_path / "d"), max_count=10) as w:
        for i in range(8):
            w.write({"__key__": f"k{i}", "cls": i, **({"txt": f"t{i}"} if i % 2 else {})})
    with pytest.raises(SampleError, match=r"has no field 'txt'.*missing='union'"):
        list(ShardStream(str(tmp_path / "d"), batch_size=4, shuffle=False, world=World(0, 1)))
    union = functools.partial(default_collate, missing="union")
    batches = list(make_loader(ShardStream(str(tmp_path / "d"), batch_size=4, shuffle=False, collate=union, world=World(0, 1)), num_workers=2))
    txt = [t for b in batches for t in b["txt"]]
    mask = torch.cat([b[PRESENT]["txt"] for b in batches]).tolist()
    keys = [k for b in batches for k in b["__key__"]]
    assert sorted(keys) == [f"k{i}" for i in range(8)]
    assert all(t == (f"{k.replace('k', 't')}" if int(k[1:]) % 2 else None) for t, k in zip(txt, keys))
    assert mask == [int(k[1:]) % 2 == 1 for k in keys]


def test_collate_modes():
    a = {"__source__": "a", "x": torch.ones(2), "n": 1}
    b = {"__source__": "b", "x": torch.ones(2), "t": "hi", "v": torch.arange(3), "f": 2.5}
    got = default_collate([a, b, a])
    assert torch.equal(got["x"], torch.ones(3, 2)) and torch.equal(got["n"], torch.tensor([1, 0, 1]))
    assert got["t"] == [None, "hi", None] and torch.equal(got["v"], torch.tensor([[0, 0, 0], [0, 1, 2], [0, 0, 0]]))
    assert torch.equal(got["f"], torch.tensor([0.0, 2.5, 0.0], dtype=torch.float64))
    assert got[PRESENT]["n"].tolist() == [True, False, True] and got[PRESENT]["t"].tolist() == [False, True, False]
    assert present(got, "x").tolist() == [True] * 3 and present(got, "nowhere").tolist() == [False] * 3
    uniform = default_collate([a, a])
    assert PRESENT not in uniform and present(uniform, "t").tolist() == [False, False]
    # present tensors of different shapes stay a list, with None where missing
    odd = default_collate([{**a, "v": torch.zeros(2)}, b])
    assert isinstance(odd["v"], list) and odd["v"][1] is b["v"] and odd["v"][0].shape == (2,)
    assert default_collate([a, {**b, "v": None}])["v"] == [None, None]
    with pytest.raises(SampleError, match="has no field"):
        default_collate([a, b], missing="error")
    with pytest.raises(SampleError, match="both from source 'a'"):
        default_collate([a, {**a, "t": "x"}])
    with pytest.raises(ConfigError, match="missing"):
        default_collate([a], missing="sometimes")
    # tuples of dicts: each dict column by the same rules
    pair = default_collate([(a, 1), (b, 2)])
    assert pair[0]["t"] == [None, "hi"] and torch.equal(pair[1], torch.tensor([1, 2]))
    # a union batch survives pickling (the DataLoader hand-off) and the plain DataLoader's convert
    back = pickle.loads(pickle.dumps(got))
    assert back["t"] == [None, "hi", None] and torch.equal(back[PRESENT]["n"], got[PRESENT]["n"])
    converted = torch.utils.data.default_convert(got)
    assert converted["t"] == [None, "hi", None] and converted[PRESENT]["t"].dtype == torch.bool


def test_a_plain_dataloader_and_to_device_carry_union_batches(sets):
    from shardstream import to_device

    ds = ShardStream(mix_of(sets), batch_size=4, seed=3, world=World(0, 1))
    plain = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))
    moved = list(to_device(make_loader(ds, num_workers=2, pin_memory=False), "cpu"))
    for batches in (plain, moved):
        assert sorted(k for b in batches for k in zip(b["__source__"], b["__key__"])) == sorted(
            [("img", k) for k in IMAGE_KEYS] + [("cap", k) for k in CAPTION_KEYS]
        )
        for b in batches:
            if PRESENT in b:
                assert all((t is not None) == bool(m) for t, m in zip(b["txt"], b[PRESENT]["txt"]))


# -- per-source transforms ------------------------------------------------------------------------
def add_empty_caption(sample):
    """The image set's samples in the caption set's shape."""
    sample["txt"] = ""
    sample["has_txt"] = False
    return sample


def caption_common(sample):
    """The caption set's samples without their extra fields (and a fresh dict, without __source__)."""
    kept = {name: sample[name] for name in ("__key__", "__url__", "jpg", "cls")}
    return {**kept, "txt": sample["txt"].upper(), "has_txt": True}


def count_chars(sample):
    sample["chars"] = len(sample["txt"])
    return sample


def drop_class_0(sample):
    return None if sample["cls"] == 0 else sample


@pytest.mark.parametrize("workers", [0, 2])
def test_per_source_transforms_give_unlike_sources_one_shape(sets, workers):
    img, cap = sets
    ds = ShardStream(
        [Source(img, name="img", transform=add_empty_caption), Source(cap, name="cap", transform=caption_common)],
        batch_size=4,
        seed=1,
        transform=count_chars,  # the stream's transform runs after each source's
        world=World(0, 1),
    )
    batches = list(make_loader(ds, num_workers=workers, log_interval=None, pin_memory=False))
    assert all(set(b) == {"__key__", "__url__", "__source__", "jpg", "cls", "txt", "has_txt", "chars"} for b in batches)  # uniform: no masks
    got = {
        (s, k): (t, h, c)
        for b in batches
        for s, k, t, h, c in zip(b["__source__"], b["__key__"], b["txt"], b["has_txt"].tolist(), b["chars"].tolist())
    }
    assert len(got) == 24
    for (source, key), (txt, has, chars) in got.items():
        if source == "img":
            assert (txt, has, chars) == ("", False, 0)
        else:
            n = CAPTION_KEYS.index(key)
            assert (txt, has, chars) == (f"CAPTION {n}", True, len(f"caption {n}"))


class SeededTag:
    """A seeded per-source transform: it records what ShardStream binds (epoch, then each sample's name)."""

    def __init__(self, tag):
        self.tag, self.epoch, self.name = tag, None, None

    def bind(self, epoch, rank, worker):
        self.epoch = epoch

    def bind_sample(self, name):
        self.name = name

    def __call__(self, sample):
        sample["seeded"] = f"{self.tag}:{self.epoch}:{self.name}"
        return {name: value for name, value in sample.items() if name in ("__key__", "__url__", "cls", "seeded")}


def test_per_source_transforms_are_bound_per_epoch_and_sample_in_workers(sets):
    img, cap = sets
    ds = ShardStream(
        [Source(img, name="img", transform=SeededTag("i")), Source(cap, name="cap", transform=SeededTag("c"))], batch_size=4, world=World(0, 1)
    )
    ds.set_epoch(3)
    batches = list(make_loader(ds, num_workers=2, log_interval=None, pin_memory=False))
    for b in batches:
        for source, key, url, seeded in zip(b["__source__"], b["__key__"], b["__url__"], b["seeded"]):
            assert seeded == f"{source[0]}:3:{url.rsplit('/', 1)[-1]}/{key}"  # its own source's function, bound to (epoch, sample)
    assert sum(len(b["__key__"]) for b in batches) == 24


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_mix_files_name_per_source_transforms(sets, tmp_path, suffix):
    img, cap = sets
    doc = {
        "sources": [
            {"url": img, "name": "img", "transform": "test_mix_unlike:drop_class_0"},
            {"url": cap, "name": "cap"},
        ]
    }
    mix = tmp_path / f"mix{suffix}"
    if suffix == ".yaml":
        import yaml

        mix.write_text(yaml.safe_dump(doc))
    else:
        mix.write_text(json.dumps(doc))
    ds = ShardStream(str(mix), batch_size=4, seed=0, world=World(0, 1))
    batches = list(make_loader(ds, num_workers=2, log_interval=None, pin_memory=False))
    kept = {(s, k) for b in batches for s, k in zip(b["__source__"], b["__key__"])}
    assert {k for s, k in kept if s == "img"} == {k for k in IMAGE_KEYS if not k.startswith("class_0")}  # that source only
    assert {k for s, k in kept if s == "cap"} == set(CAPTION_KEYS)
    assert ds.stats()["samples_filtered"] == 4


def test_bad_transform_names_are_config_errors(sets, tmp_path):
    img, cap = sets
    with pytest.raises(ConfigError, match="module:function"):
        Source(img, transform="no colon")
    bad = (("no_such_module_xyz:f", "cannot import"), ("test_mix_unlike:nothing_here", "has no"), ("test_mix_unlike:IMAGE_KEYS", "not a function"))
    for spec, message in bad:
        with pytest.raises(ConfigError, match=f"mix source 'img'.*{message}"):
            ShardStream([Source(img, name="img", transform=spec), Source(cap, name="cap")], batch_size=4, world=World(0, 1))
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"sources": [{"url": img, "transform": 3}]}))
    with pytest.raises(ConfigError, match="source 1: transform names a function"):
        ShardStream(str(mix), batch_size=4, world=World(0, 1))


# -- one field for .jpg, .png and .webp ------------------------------------------------------------
def write_mixed_folder(root):
    """An ImageFolder whose files are .jpg, .png and .webp by turns; returns {key: format}."""
    rng = np.random.default_rng(7)
    formats = {}
    for c in range(2):
        for i in range(6):
            key = f"class_{c}/{i:04d}"
            ext = ("jpg", "png", "webp")[(c * 6 + i) % 3]
            path = root / f"{key}.{ext}"
            path.parent.mkdir(parents=True, exist_ok=True)
            _image(rng).save(path, **({"lossless": True} if ext == "webp" else {}))
            formats[key] = ext
    return formats


def test_an_image_folder_of_jpg_png_and_webp_trains_as_one_field(tmp_path):
    formats = write_mixed_folder(tmp_path / "folder")
    pack(str(tmp_path / "folder"), str(tmp_path / "ds"), label_from_dir=True, max_count=4)
    with pytest.raises(SampleError, match=r"alias=\{'image': '(jpg|png|webp);(jpg|png|webp)'\}"):
        list(ShardStream(str(tmp_path / "ds"), batch_size=4, shuffle=False, world=World(0, 1)))
    decode = Decode(alias={"image": "jpg;png;webp"}, required=["image"])
    ds = ShardStream(str(tmp_path / "ds"), batch_size=4, seed=0, decode=decode, world=World(0, 1))
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    keys = []
    for batch in make_loader(ds, num_workers=2, log_interval=None, pin_memory=False):
        assert set(batch) == {"__key__", "__url__", "image", "cls"} and batch["image"].shape == (4, 3, 16, 16)
        loss = torch.nn.functional.cross_entropy(model(batch["image"].float() / 255), batch["cls"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert torch.isfinite(loss)
        keys += batch["__key__"]
    assert sorted(keys) == sorted(formats) and set(formats.values()) == {"jpg", "png", "webp"}
    # the decoded pixels are each file's own (png and lossless webp exactly)
    one = ShardStream(str(tmp_path / "ds"), batch_size=1, shuffle=False, decode=Decode(alias={"image": ["jpg", "png", "webp"]}), world=World(0, 1))
    for b in one:
        key = b["__key__"][0]
        if formats[key] != "jpg":
            pixels = np.array(Image.open(tmp_path / "folder" / f"{key}.{formats[key]}").convert("RGB"))
            assert np.array_equal(b["image"][0].permute(1, 2, 0).numpy(), pixels)


def test_alias_takes_the_first_alternative_and_checks_itself():
    from shardstream.pipeline.decode import Decoder, default_decoders

    decoder = Decoder(default_decoders(), required=["image"], alias={"image": ("png", "jpg")})
    both = decoder({"__key__": "k", "jpg": _png_bytes(2), "png": _png_bytes(), "txt": b"t"})
    assert set(both) == {"__key__", "image", "txt"} and both["image"].shape == (3, 1, 1)  # the png (first named); the jpg dropped
    with pytest.raises(SampleError, match=r"missing required field 'image' \(any of png;jpg\)"):
        decoder({"__key__": "k", "txt": b"t"})
    assert Decode(alias={"image": "jpg;png"}).alias == {"image": ("jpg", "png")}
    for bad, message in (
        ({"image": ""}, "lists the extensions"),
        ({"__x__": "jpg"}, "not a field name"),
        ({"a": "jpg", "b": "jpg;png"}, "alternative of both"),
        (["jpg"], "maps a field name"),
        ({"image": "jpg; png"}, "lists the extensions"),
    ):
        with pytest.raises(ConfigError, match=message):
            Decode(alias=bad)


def _png_bytes(size=1):
    import io

    out = io.BytesIO()
    Image.new("RGB", (size, size)).save(out, format="PNG")
    return out.getvalue()


# -- resume ---------------------------------------------------------------------------------------
def _run(loader, stop=None):
    got = []
    for batch in loader:
        got.append(batch)
        if stop is not None and len(got) == stop:
            break
    return got, json.loads(json.dumps(loader.state_dict()))


def _same_batches(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert set(x) == set(y)
        for name in x:
            if name == PRESENT:
                assert set(x[name]) == set(y[name]) and all(torch.equal(x[name][f], y[name][f]) for f in x[name])
            elif isinstance(x[name], torch.Tensor):
                assert torch.equal(x[name], y[name]), name
            else:
                assert x[name] == y[name], name


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_pass_over_an_unlike_mix_equals_the_uninterrupted_one(sets, workers):
    def fresh():
        ds = ShardStream(mix_of(sets), batch_size=4, seed=5, shuffle=Shuffle(8), world=World(0, 1), schedule=Schedule(steps=9))
        return make_loader(ds, num_workers=workers, log_interval=None, pin_memory=False)

    whole, _ = _run(fresh())
    assert len(whole) == 9 and any(PRESENT in b for b in whole)
    for stop in (2, 7):
        _, state = _run(fresh(), stop)
        resumed = fresh()
        resumed.load_state_dict(state)
        rest, _ = _run(resumed)
        _same_batches(rest, whole[stop:])

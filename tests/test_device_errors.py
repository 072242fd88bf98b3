"""to_device on a device this machine lacks: one ConfigError naming the device and the devices there
are, raised when to_device is called (not torch's own error at the first copy). On a machine with
CUDA (the GPU runs) "cuda" is accepted and a CUDA index past the last is refused."""

from __future__ import annotations

import pytest
import torch

from shardstream import ShardStream, make_loader, to_device
from shardstream.device import available_devices
from shardstream.errors import ConfigError


def test_available_devices_lists_the_cpu_and_each_visible_gpu():
    found = available_devices()
    assert found[0] == "cpu"
    assert [d for d in found if d.startswith("cuda")] == [f"cuda:{i}" for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0)]


def test_cuda_without_cuda_is_one_config_error_naming_what_there_is(tmp_path):
    from conftest import write_dataset

    loader = make_loader(ShardStream(write_dataset(tmp_path / "ds", n=8, max_count=4), batch_size=4), num_workers=0)
    if torch.cuda.is_available():
        batches = list(to_device(loader, "cuda"))
        assert len(batches) == 2 and all(t.is_cuda for b in batches for t in b.values() if isinstance(t, torch.Tensor))
        past = f"cuda:{torch.cuda.device_count()}"
        with pytest.raises(ConfigError) as raised:
            to_device(loader, past)
        assert f"'{past}'" in str(raised.value) and "available: cpu, cuda:0" in str(raised.value)
        return
    with pytest.raises(ConfigError) as raised:
        to_device(loader, "cuda")
    message = str(raised.value)
    assert "\n" not in message and "'cuda'" in message and message.endswith("available: cpu")
    if torch.version.cuda is None:
        assert "built without CUDA" in message and torch.__version__ in message
    with pytest.raises(ConfigError, match=r"'cuda:1'.*available: cpu$"):
        to_device(loader, "cuda:1")


def test_a_name_that_is_no_device_is_a_config_error():
    with pytest.raises(ConfigError, match=r"'gpu' is not a device .*available here: cpu"):
        to_device([], "gpu")


def test_the_cpu_and_meta_devices_are_always_there():
    assert to_device([], "cpu").device == torch.device("cpu")
    assert to_device([], torch.device("meta")).device.type == "meta"

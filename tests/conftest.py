"""Shared fixtures: a real moto S3 server on 127.0.0.1 (real HTTP through s3fs and boto3) and
small datasets on disk."""

from __future__ import annotations

import json
import os
import socket
import uuid

import numpy as np
import pytest
from PIL import Image

os.environ.setdefault("OMP_NUM_THREADS", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server on loopback; dummy credentials in the environment for boto3 and s3fs."""
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    os.environ.pop("AWS_SESSION_TOKEN", None)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3(s3_endpoint):
    """A fresh bucket; yields (bucket name, storage_options for shardstream, boto3 client)."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    yield bucket, {"endpoint_url": s3_endpoint}, client


def write_image_folder(root, classes=3, per_class=5, size=16, fmt="png", seed=0, with_json=True):
    """An ImageFolder tree: root/class_i/NNNN.png (+ .json). Returns the list of keys."""
    rng = np.random.default_rng(seed)
    keys = []
    for c in range(classes):
        folder = root / f"class_{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            arr = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
            Image.fromarray(arr).save(folder / f"{i:04d}.{fmt}")
            if with_json:
                (folder / f"{i:04d}.json").write_text(json.dumps({"i": i, "c": c}))
            keys.append(f"class_{c}/{i:04d}")
    return keys


@pytest.fixture
def image_folder(tmp_path):
    root = tmp_path / "images"
    keys = write_image_folder(root)
    return root, keys


def make_samples(n: int, size: int = 100, seed: int = 0):
    """n small samples with bin/cls/txt fields and distinct keys."""
    rng = np.random.default_rng(seed)
    return [
        {"__key__": f"s{i:06d}", "bin": rng.bytes(int(rng.integers(1, size + 1))), "cls": i % 7, "txt": f"sample {i}"}
        for i in range(n)
    ]

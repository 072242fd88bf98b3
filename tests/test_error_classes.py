"""Every storage error a caller of ``ShardStream(...)`` can see is the class errors.md names for
it (AccessDenied, StorageNotFound, BucketNotFound, NoCredentials, ...), and, where it was met
while reading a manifest, still a ManifestError (a mix file: still a ConfigError): either
``except`` catches it. Against the moto server, with authentication switched on where the test
needs credentials checked."""

from __future__ import annotations

import os
import pickle

import pytest
from conftest import forget_aws_credentials, make_samples, write_dataset
from test_auth import _options, _set_auth, auth  # noqa: F401 - auth: the fixture, used by name

from shardstream import (
    AccessDenied,
    BucketNotFound,
    ConfigError,
    ManifestError,
    NoCredentials,
    ShardStream,
    StorageError,
    StorageNotFound,
    Store,
    World,
)


def _open(url: str, options: dict | None, **kw) -> ShardStream:
    return ShardStream(url, batch_size=5, world=World(0, 1), store=Store(options=options), **kw)


def _caught(url: str, options: dict | None, cls: type) -> BaseException:
    with pytest.raises(cls) as info:
        _open(url, options)
    return info.value


def test_wrong_credentials_are_access_denied_and_a_manifest_error(auth):  # noqa: F811
    url, endpoint, users = auth
    for user, says in (
        ({"key": "AKIANOBODYKNOWS00000", "secret": "x"}, "access key ID is not known to this endpoint"),
        ({"key": users["reader"]["key"], "secret": "wrong"}, "secret key does not match the access key ID"),
    ):
        exc = _caught(url, _options(endpoint, user), AccessDenied)
        assert says in str(exc) and "index.json" in str(exc)
        assert isinstance(exc, ManifestError) and isinstance(exc, PermissionError) and exc.url.endswith("index.json")


def test_a_manifest_the_credentials_may_not_read_is_access_denied(auth, s3):  # noqa: F811
    url, endpoint, users = auth
    bucket, options, _ = s3
    _set_auth(endpoint, "inf")  # a second dataset the manifest-only user has no grant for, written as admin
    try:
        other = write_dataset(url.replace("/ds", "/other"), n=10, max_count=5, storage_options=options)
    finally:
        _set_auth(endpoint, "0")
    exc = _caught(other, _options(endpoint, users["manifest-only"]), AccessDenied)
    assert "access denied" in str(exc) and "other/index.json" in str(exc)
    assert isinstance(exc, ManifestError) and isinstance(exc, StorageError)
    with pytest.raises(ManifestError):  # the old contract still holds
        _open(other, _options(endpoint, users["manifest-only"]))


def test_a_missing_bucket_and_a_missing_manifest_are_not_found(s3):
    bucket, options, _ = s3
    exc = _caught("s3://no-such-bucket-classes/data", options, BucketNotFound)
    assert isinstance(exc, ManifestError) and isinstance(exc, StorageNotFound) and isinstance(exc, FileNotFoundError)
    assert "no-such-bucket-classes" in str(exc)
    exc = _caught(f"s3://{bucket}/nothing-here", options, StorageNotFound)
    assert not isinstance(exc, BucketNotFound) and isinstance(exc, ManifestError)
    assert "cannot read the manifest (not found)" in str(exc) and exc.url == f"s3://{bucket}/nothing-here/index.json"


def test_no_credentials_is_no_credentials_and_a_manifest_error(s3, monkeypatch, tmp_path):
    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/ds", n=10, max_count=5, storage_options=options)
    forget_aws_credentials(monkeypatch, tmp_path)
    exc = _caught(url, {"endpoint_url": options["endpoint_url"], "skip_instance_cache": True}, NoCredentials)
    assert isinstance(exc, ManifestError) and "no credentials found" in str(exc)


def test_a_missing_mix_file_is_not_found_and_still_a_config_error(s3):
    bucket, options, _ = s3
    exc = _caught(f"s3://{bucket}/mixes/none.json", options, StorageNotFound)
    assert isinstance(exc, ConfigError) and "cannot read the mix file" in str(exc)


def test_a_mix_source_that_cannot_be_read_keeps_both_classes(s3, tmp_path):
    from shardstream import Source

    bucket, options, _ = s3
    here = write_dataset(tmp_path / "here", n=10, max_count=5)
    sources = [Source(here, name="here"), Source(f"s3://{bucket}/gone", name="gone", storage_options=options)]
    with pytest.raises(StorageNotFound, match=r"mix source 'gone': .*gone/index\.json: cannot read the manifest \(not found\)") as info:
        ShardStream(sources, batch_size=5, world=World(0, 1))
    assert isinstance(info.value, ManifestError) and info.value.url == f"s3://{bucket}/gone/index.json"


def test_a_missing_offset_sidecar_is_not_found_naming_its_shard(tmp_path):
    root = write_dataset(tmp_path / "ds", n=40, max_count=40, samples=make_samples(40), member_sidecars=False)
    os.remove(os.path.join(root, "shard-000000.tar.idx"))
    ds = ShardStream(root, batch_size=5, shuffle=False, world=World(1, 2))  # rank 1 starts mid-shard: offsets needed
    with pytest.raises(StorageNotFound, match=r"shard-000000\.tar\.idx: cannot read the offset sidecar of .*shard-000000\.tar"):
        list(ds)


def test_the_combined_classes_pickle_and_rebuild_from_their_message(s3):
    bucket, options, _ = s3
    exc = _caught(f"s3://{bucket}/nothing-here", options, StorageNotFound)
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is type(exc) and str(again) == str(exc) and again.url == exc.url
    assert type(type(exc)(str(exc))) is type(exc)  # how DataLoader re-raises a worker's exception

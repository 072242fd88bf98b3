"""Credentials and permissions against the moto server with authentication switched on (its
``/moto-api/reset-auth``): an unknown access key, a wrong secret, a user who may read the
manifest but not the shards, a read-only user who tries to pack, and ``--profile`` from a
credentials file. Each fails at once, with no retries, saying what to check."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid

import pytest
from conftest import make_samples

from shardstream import ShardStream, ShardWriter, Store, World
from shardstream.cli.main import main as cli_main
from shardstream.errors import DestinationError, ManifestError, StorageError


def _set_auth(endpoint: str, value: str) -> None:
    request = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=value.encode(), method="POST", headers={"Content-Type": "text/plain"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.load(response)["status"] == "ok"


def _user(iam, name: str, statements: list[dict]) -> dict:
    iam.create_user(UserName=name)
    iam.put_user_policy(UserName=name, PolicyName="p", PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": statements}))
    key = iam.create_access_key(UserName=name)["AccessKey"]
    return {"key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}


@pytest.fixture
def auth(s3, tmp_path, monkeypatch):
    """A dataset, IAM users with narrow policies and a credentials file; authentication enforced
    for the test's duration. Yields (dataset URL, endpoint, {user: {key, secret}})."""
    import boto3

    bucket, options, _ = s3
    endpoint = options["endpoint_url"]
    url = f"s3://{bucket}/ds"
    with ShardWriter(url, max_count=20, storage_options=options) as w:
        for s in make_samples(50):
            w.write(s)
    iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1")
    tag = uuid.uuid4().hex[:8]
    bucket_arn = f"arn:aws:s3:::{bucket}"
    users = {
        "reader": _user(
            iam,
            f"reader-{tag}",
            [
                {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": f"{bucket_arn}/*"},
                {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": bucket_arn},
            ],
        ),
        "manifest-only": _user(
            iam,
            f"manifest-{tag}",
            [
                {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": f"{bucket_arn}/ds/index.json"},
                {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": bucket_arn},
            ],
        ),
    }
    creds = tmp_path / "credentials"
    creds.write_text(
        "".join(f"[{name}]\naws_access_key_id = {u['key']}\naws_secret_access_key = {u['secret']}\n" for name, u in users.items())
        + "[stranger]\naws_access_key_id = AKIANOBODYKNOWS00000\naws_secret_access_key = nope\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    _set_auth(endpoint, "0")
    try:
        yield url, endpoint, users
    finally:
        _set_auth(endpoint, "inf")


def _options(endpoint: str, user: dict | None = None, **extra) -> dict:
    options = {"endpoint_url": endpoint, **extra}
    if user is not None:
        options.update(key=user["key"], secret=user["secret"])
    return options


def test_unknown_access_key_and_wrong_secret_say_which(auth):
    url, endpoint, users = auth
    started = time.monotonic()
    with pytest.raises(ManifestError, match="access key ID is not known to this endpoint"):
        ShardStream(url, batch_size=5, world=World(0, 1), store=Store(options=_options(endpoint, {"key": "AKIANOBODYKNOWS00000", "secret": "x"})))
    with pytest.raises(ManifestError, match="secret key does not match the access key ID"):
        ShardStream(url, batch_size=5, world=World(0, 1), store=Store(options=_options(endpoint, {"key": users["reader"]["key"], "secret": "wrong"})))
    assert time.monotonic() - started < 20


def test_permission_denied_on_a_shard_fails_fast_naming_it(auth):
    url, endpoint, users = auth
    ds = ShardStream(url, batch_size=5, shuffle=False, world=World(0, 1), store=Store(options=_options(endpoint, users["manifest-only"])))
    assert ds.manifest.total_samples == 50  # the manifest itself was readable
    # the shard's member sidecar is its first object read (pack wrote one): named, with the shard
    with pytest.raises(
        StorageError,
        match=r"ds/shard-000000\.tar\.members: cannot read the member sidecar of s3://.*/ds/shard-000000\.tar "
        r".*access denied: these credentials may not do this",
    ) as info:
        list(ds)
    assert "re-pack" not in str(info.value)  # advice for a sidecar that does not fit, not for credentials
    assert ds.stats()["retries"] == 0  # fails fast: no retry on a 403


def test_the_right_credentials_read_everything(auth):
    url, endpoint, users = auth
    ds = ShardStream(url, batch_size=5, shuffle=False, world=World(0, 1), store=Store(options=_options(endpoint, users["reader"])))
    keys = [k for batch in ds for k in batch["__key__"]]
    assert keys == [s["__key__"] for s in make_samples(50)]


def test_read_only_credentials_cannot_pack(auth, tmp_path):
    url, endpoint, users = auth
    dest = url.rsplit("/", 1)[0] + "/new"
    with pytest.raises(DestinationError, match="access denied: these credentials may not do this"):
        with ShardWriter(dest, max_count=10, storage_options=_options(endpoint, users["reader"])) as w:
            for s in make_samples(5):
                w.write(s)


def test_cli_profile_picks_credentials_from_the_file(auth, capsys):
    url, endpoint, _ = auth
    # The environment's AWS_ACCESS_KEY_ID (the fixture's "testing") is unknown once auth is on;
    # --profile must take the file's credentials instead.
    assert cli_main(["ls", url, "--endpoint-url", endpoint, "--profile", "reader", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 50
    assert cli_main(["ls", url, "--endpoint-url", endpoint]) != 0
    err = capsys.readouterr().err
    assert "access key ID is not known" in err and "Traceback" not in err
    assert cli_main(["ls", url, "--endpoint-url", endpoint, "--profile", "stranger"]) != 0
    assert "access key ID is not known" in capsys.readouterr().err
    assert cli_main(["verify", url, "--endpoint-url", endpoint, "--profile", "manifest-only"]) != 0
    out = capsys.readouterr()
    assert "shard-000000.tar" in out.out + out.err and "access denied" in out.out + out.err

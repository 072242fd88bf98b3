"""No secret in a repr or in shardstream's own log: every object that holds credentials prints them
masked, and a DEBUG-level read through a faulty store logs no key, secret or signature."""

from __future__ import annotations

import logging

from conftest import write_dataset
from faultproxy import FaultProxy

from shardstream import Read, ShardStream, StorageConfig, Store, World
from shardstream.redact import get_logger, mask_options, redact
from shardstream.sources import Source

KEY_ID = "AKIAIOSFODNN7EXAMPLE"
SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"
TOKEN = "FwoGZXIvYXdzEBYaDHqa0AP1Token0123456789"
SECRETS = (KEY_ID, SECRET, TOKEN, "hunter2-password")


def _leaks(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


def test_objects_holding_credentials_print_them_masked():
    options = {
        "key": KEY_ID,
        "secret": SECRET,
        "token": TOKEN,
        "endpoint_url": "http://127.0.0.1:9",
        "client_kwargs": {"aws_session_token": TOKEN, "region_name": "us-east-1"},
        "password": "hunter2-password",
    }
    store = Store(options=options)
    source = Source("s3://b/ds", storage_options=options)
    for text in (repr(store), str(store), repr(source), str(source), repr(mask_options(options))):
        assert not _leaks(text), text
        assert "***" in text and "http://127.0.0.1:9" in text and "us-east-1" in text  # the rest still shown
    assert "AKIA***" in repr(store)  # which key, not the key
    assert store.options["secret"] == SECRET  # masked in print only


def test_an_obstore_client_prints_its_credentials_masked():
    from shardstream.storage import objects

    client = objects.Client("bkt", {"key": KEY_ID, "secret": SECRET, "token": TOKEN, "endpoint_url": "http://127.0.0.1:9"}, StorageConfig())
    assert not _leaks(repr(client)) and "bkt" in repr(client)


def test_redact_masks_signatures_headers_and_keys():
    header = f"Authorization: AWS4-HMAC-SHA256 Credential={KEY_ID}/20261201/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=0123abcdef"
    presigned = f"https://b.s3.amazonaws.com/k?X-Amz-Credential={KEY_ID}%2F2026&X-Amz-Signature=deadbeef99&X-Amz-Security-Token={TOKEN}"
    for text in (header, presigned, f"options {{'secret': '{SECRET}', 'token': '{TOKEN}'}}", "https://user:hunter2-password@host/x"):
        out = redact(text)
        assert not _leaks(out) and "0123abcdef" not in out and "deadbeef99" not in out, out


def test_a_shardstream_log_record_is_redacted(caplog):
    caplog.set_level(logging.DEBUG, logger="shardstream")
    get_logger("shardstream.storage.retry").debug("request failed: %s", f"Authorization: AWS4-HMAC-SHA256 Signature=abc123; secret={SECRET}")
    assert caplog.records and "abc123" not in caplog.text and not _leaks(caplog.text)


def test_a_debug_run_against_moto_logs_no_secret(s3, caplog):
    """A real read with explicit credentials through a store that cuts and throttles (so every retry
    path logs), with the shardstream logger at DEBUG: no key, secret, token or signature in it."""
    bucket, options, _ = s3
    url = write_dataset(f"s3://{bucket}/secret-log", 40, max_count=20, size=3000, storage_options=options)
    caplog.set_level(logging.DEBUG, logger="shardstream")
    with FaultProxy(options["endpoint_url"], reset_after=5000, slowdown_every=3) as proxy:
        given = {"endpoint_url": proxy.url, "key": KEY_ID, "secret": SECRET, "token": TOKEN}
        config = StorageConfig(backoff_base=0.001, backoff_cap=0.01)
        ds = ShardStream(url, batch_size=5, shuffle=False, world=World(0, 1), store=Store(options=given, config=config, read=Read(readahead_bytes=0)))
        logging.getLogger("shardstream.dataset").debug("store: %r", ds.store)
        assert sum(len(b["__key__"]) for b in ds) == 40
    assert ds.stats()["retries"] > 0 and "retrying" in caplog.text  # the retries were logged
    assert not _leaks(caplog.text) and "Signature=" not in caplog.text

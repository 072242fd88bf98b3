"""benchmarks/latency_proxy.py, the 30 ms proxy the S3 benchmarks read through: ranged GETs
(explicit and suffix ranges, as object_store reads a Parquet footer for polars and obstore)
pass through it byte-exact with their Content-Range, on kept-alive connections, and every
request is counted; in front of a moto S3 server, by boto3 and by obstore (object_store)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: the benchmarks package

from benchmarks.latency_proxy import proxy_counts, start_proxy


@pytest.fixture
def proxied(s3):
    bucket, options, client = s3
    data = os.urandom(300_000)
    client.put_object(Bucket=bucket, Key="obj.bin", Body=data)
    with start_proxy(options["endpoint_url"], 0.0) as (url, _):
        yield bucket, url, data


def test_ranged_gets_through_the_proxy_are_byte_exact_on_kept_alive_connections(proxied):
    import boto3

    bucket, url, data = proxied
    client = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
    part = client.get_object(Bucket=bucket, Key="obj.bin", Range="bytes=1000-263143")
    assert part["ResponseMetadata"]["HTTPStatusCode"] == 206 and part["ContentRange"] == f"bytes 1000-263143/{len(data)}"
    assert part["Body"].read() == data[1000:263144]
    tail = client.get_object(Bucket=bucket, Key="obj.bin", Range="bytes=-262144")  # the last 262,144 bytes
    assert tail["ContentRange"] == f"bytes {len(data) - 262144}-{len(data) - 1}/{len(data)}"
    assert tail["Body"].read() == data[-262144:]
    assert client.get_object(Bucket=bucket, Key="obj.bin")["Body"].read() == data
    assert client.head_object(Bucket=bucket, Key="obj.bin")["ContentLength"] == len(data)
    counts = proxy_counts(url)
    assert counts.get("GET") == 3 and counts.get("HEAD") == 1, counts


def test_object_store_reads_ranges_and_suffixes_through_the_proxy(proxied):
    import obstore
    from obstore.store import S3Store

    bucket, url, data = proxied
    store = S3Store(
        bucket,
        endpoint=url,
        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        region="us-east-1",
        client_options={"allow_http": True},
        virtual_hosted_style_request=False,
    )
    assert bytes(obstore.get_range(store, "obj.bin", start=1000, end=263144)) == data[1000:263144]
    assert bytes(obstore.get(store, "obj.bin", options={"range": {"suffix": 262144}}).bytes()) == data[-262144:]
    ranges = obstore.get_ranges(store, "obj.bin", starts=[0, 299_000], ends=[10, 300_000])
    assert [bytes(r) for r in ranges] == [data[:10], data[299_000:]]
    assert proxy_counts(url).get("GET", 0) >= 3

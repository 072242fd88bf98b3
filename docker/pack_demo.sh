#!/bin/sh
# Create the demo bucket on the S3 server named by AWS_ENDPOINT_URL and pack the synthetic
# dataset into it: the first half of `make demo`, over S3.
set -eu
python - <<'PY'
import boto3

s3 = boto3.client("s3")  # botocore reads AWS_ENDPOINT_URL
try:
    s3.create_bucket(Bucket="demo")
except s3.exceptions.BucketAlreadyOwnedByYou:
    pass
PY
python benchmarks/make_synthetic.py /tmp/demo-src --classes 10 --per-class 100 --size 32
shardstream pack /tmp/demo-src s3://demo/shards --label-from-dir --max-count 100 --shuffle --seed 0 --overwrite

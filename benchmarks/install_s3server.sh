#!/usr/bin/env bash
# Install a real S3-compatible server for benchmarks/s3server.py (not run by CI; the tests use moto).
#
#   bash benchmarks/install_s3server.sh s3rver      # npm package s3rver 3.7.1 (Node, a file backend)
#   bash benchmarks/install_s3server.sh seaweedfs   # SeaweedFS's weed, built from its Go module
#
# Everything goes under ~/.cache/shardstream/ (outside the clone; a later run reuses it).
#
# s3rver needs node and npm (Debian: apt-get install nodejs npm). SeaweedFS is not on PyPI or npm:
# it is the Go module github.com/seaweedfs/seaweedfs and needs a newer Go than Debian 12's 1.19,
# taken as the Go module golang.org/toolchain through GOTOOLCHAIN (which needs a go >= 1.21 to
# start from) and the Go module proxy. On 2026-11-27 the benchmark machine could not reach the Go
# module proxy, so BENCHMARKS.md's figures are on s3rver. The build is long (minutes on 2 cores):
# it runs under nice.
set -euo pipefail

CACHE="${HOME}/.cache/shardstream"
S3RVER_VERSION=3.7.1
SEAWEEDFS_VERSION=v0.0.0-20261109003541-7506e5f91cd6
GO_TOOLCHAIN=go1.27.3

kind="${1:-s3rver}"
case "$kind" in
  s3rver)
    command -v node >/dev/null || { echo "node is not installed (apt-get install nodejs npm)" >&2; exit 1; }
    mkdir -p "$CACHE/s3rver"
    cd "$CACHE/s3rver"
    [ -f package.json ] || npm init -y >/dev/null
    nice -n 19 npm install --no-audit --no-fund "s3rver@${S3RVER_VERSION}"
    node node_modules/s3rver/bin/s3rver.js --version
    echo "s3rver installed: $CACHE/s3rver/node_modules/s3rver/bin/s3rver.js"
    ;;
  seaweedfs)
    command -v go >/dev/null || { apt-get update -qq && apt-get install -y -qq golang-go; }
    export GOTOOLCHAIN="$GO_TOOLCHAIN"
    export GOPATH="$CACHE/go" GOFLAGS=-modcacherw
    if ! go version | grep -q "$GO_TOOLCHAIN"; then
      echo "go is $(go version); $GO_TOOLCHAIN did not come through GOTOOLCHAIN (it needs go >= 1.21 and the Go module proxy)" >&2
      exit 1
    fi
    mkdir -p "$CACHE/seaweedfs"
    GOBIN="$CACHE/seaweedfs" nice -n 19 go install "github.com/seaweedfs/seaweedfs/weed@${SEAWEEDFS_VERSION}"
    "$CACHE/seaweedfs/weed" version
    echo "SeaweedFS installed: $CACHE/seaweedfs/weed"
    ;;
  *)
    echo "usage: $0 s3rver|seaweedfs" >&2
    exit 2
    ;;
esac

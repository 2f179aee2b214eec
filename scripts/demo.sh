#!/usr/bin/env bash
# Set up .venv (created on first use) and run `ckpt demo`; arguments go to the demo
# (e.g. --root s3://bucket/run --framework keras).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh "dev,keras,paddle"
exec .venv/bin/ckpt demo "$@"

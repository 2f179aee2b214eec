#!/usr/bin/env bash
# Set up .venv (created and installed on first use) and run `ckpt demo`; arguments go to the demo
# (e.g. --root s3://bucket/run -o client_kwargs.endpoint_url=http://127.0.0.1:5000 --framework keras; also paddle, torch, jax).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh "dev,keras,paddle,torch,lightning,jax,metrics"
# The framework demos' workers inherit these: TensorFlow's C++ log, oneDNN notices and Paddle's
# glog stay out of the demonstration (a value already set by the user wins).
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-3}" TF_ENABLE_ONEDNN_OPTS="${TF_ENABLE_ONEDNN_OPTS:-0}"
export GLOG_minloglevel="${GLOG_minloglevel:-3}" FLAGS_call_stack_level="${FLAGS_call_stack_level:-0}"
exec .venv/bin/ckpt demo "$@"

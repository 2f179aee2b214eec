#!/usr/bin/env bash
# Set up .venv (created on first use) and run the whole test suite.
# The core runs first; each framework's tests run in a pytest process of their own, because
# importing TensorFlow before Paddle in one process crashes.  Extra arguments go to every pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh "dev,keras,paddle"
# Azurite (Azure Blob Storage's emulator, an npm package) for the Azure tests: once, into
# .venv/node.  Without npm, or if the install fails, those tests are skipped with the reason.
if [ ! -x .venv/node/node_modules/.bin/azurite-blob ] && command -v npm >/dev/null 2>&1; then
  echo "installing Azurite into .venv/node (once)..." >&2
  npm install --prefix .venv/node azurite@3 --no-audit --no-fund --silent >/dev/null 2>&1 \
    || echo "npm could not install Azurite: the Azure tests will be skipped" >&2
fi

status=0
run() {  # pytest exit 5 means "no tests collected": not a failure for an optional group
  .venv/bin/python -m pytest "$@" || { rc=$?; [ "$rc" -eq 5 ] || status=$rc; }
}
# The core suite in 2-4 worker processes (pytest-xdist), a test module per worker at a time: much
# of it waits on subprocesses and the local servers, so two workers on two cores halve its time.
# Each worker starts its own servers (session fixtures).
workers=$(nproc 2>/dev/null || echo 2)
workers=$(( workers < 2 ? 2 : (workers > 4 ? 4 : workers) ))
run tests --ignore=tests/keras_adapter --ignore=tests/paddle_adapter -n "$workers" --dist loadfile "${@}"
# Docstring examples of the core and the framework-free NumPy adapter, in a run of their own:
# --doctest-modules over tests/ would import the framework test helpers (Keras and Paddle in one
# process).  ckptcore/testing.py is the conformance suite that adapters' tests subclass, not docs.
run ckptcore adapters/ckptcore_numpy --doctest-modules --ignore=ckptcore/testing.py "${@}"
# The two frameworks' suites run at the same time, each in its own process (their tests wait on
# subprocesses and servers much of the time); each one's output is shown when both are done.
logs=$(mktemp -d)
pids=()
for fw in paddle keras; do
  if [ -d "tests/${fw}_adapter" ]; then
    .venv/bin/python -m pytest "tests/${fw}_adapter" "$@" >"$logs/$fw.log" 2>&1 &
    pids+=("$fw:$!")
  fi
done
for entry in "${pids[@]}"; do
  fw=${entry%%:*}; pid=${entry#*:}
  rc=0; wait "$pid" || rc=$?
  cat "$logs/$fw.log"
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || status=$rc
done
rm -rf "$logs"
exit $status

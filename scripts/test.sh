#!/usr/bin/env bash
# Set up .venv (created on first use) and run the whole test suite.
# The core runs first; each framework's tests run in a pytest process of their own, because
# importing TensorFlow before Paddle in one process crashes.  Extra arguments go to every pytest.
# Every suite prints its progress as it goes (the two framework suites side by side, each line
# prefixed with its name) and a summary line with its time; the last line sums them up.
set -euo pipefail
cd "$(dirname "$0")/.."
# Chromium (Debian's package) for the test that renders `ckpt report`'s page headless: installed
# with apt-get where it is missing and we may (root), in the background while the venv is set
# up; without it that test skips and says why.
chromium_log=$(mktemp)
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing chromium with apt-get (in the background)..." >&2
  ( DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >"$chromium_log" 2>&1 \
    || { apt-get update -q >>"$chromium_log" 2>&1 \
         && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >>"$chromium_log" 2>&1; } \
    || echo "apt-get could not install chromium: the report's browser test will be skipped" >&2 ) &
  chromium_pid=$!
fi
source scripts/_venv.sh "dev,keras,paddle,torch,lightning,jax,metrics"
# Azurite (Azure Blob Storage's emulator, an npm package) for the Azure tests: once, into
# .venv/node.  Without npm, or if the install fails, those tests are skipped with the reason.
if [ ! -x .venv/node/node_modules/.bin/azurite-blob ] && command -v npm >/dev/null 2>&1; then
  echo "installing Azurite into .venv/node (once)..." >&2
  npm install --prefix .venv/node azurite@3 --no-audit --no-fund --silent >/dev/null 2>&1 \
    || echo "npm could not install Azurite: the Azure tests will be skipped" >&2
fi

if [ -n "${chromium_pid:-}" ]; then wait "$chromium_pid" || true; fi
logs=$(mktemp -d)
trap 'rm -rf "$logs" "$chromium_log"' EXIT
status=0
# suite NAME PYTEST-ARGS...: one pytest process, its output shown as it goes (each line prefixed
# with NAME when PREFIX=1) and kept in $logs/NAME.log; its exit code and seconds in $logs/NAME.rc.
suite() {
  local name=$1; shift
  local start=$SECONDS rc
  set +e
  if [ "${PREFIX:-0}" = 1 ]; then
    .venv/bin/python -m pytest "$@" 2>&1 | tee "$logs/$name.log" | sed -u "s/^/[$name] /"
  else
    .venv/bin/python -m pytest "$@" 2>&1 | tee "$logs/$name.log"
  fi
  rc=${PIPESTATUS[0]}
  set -e
  echo "$rc $((SECONDS - start))" > "$logs/$name.rc"
}
# One more core-suite worker than cores (3 to 5): its tests wait on subprocesses and servers
# often enough that a worker per core leaves the CPU idle; with one more it stays busy (2 cores:
# 12 minutes with 3 workers against 13.5 with 2, measured by vmstat side by side).
workers=$(nproc 2>/dev/null || echo 2)
workers=$(( workers + 1 < 3 ? 3 : (workers + 1 > 5 ? 5 : workers + 1) ))
# Random order (pytest-randomly) for the core suite, so that a test that leaves state behind for
# another (an environment variable, a knob, a SIGTERM handler, a manager not closed) or needs
# another to run first shows up: the modules, and the tests in each, run in an order drawn from a
# seed.  The seed is drawn here (CKPT_TEST_SEED=N to choose it), written in the core log's header
# by pytest-randomly ("Using --randomly-seed=N") and again in the summary at the end (even with -q,
# which hides the header).  To replay a failing run's order:
#   CKPT_TEST_SEED=N scripts/test.sh              # the whole run again, the core in that order
#   .venv/bin/python -m pytest tests --ignore=tests/keras_adapter --ignore=tests/paddle_adapter --ignore=tests/torch_adapter --ignore=tests/jax_adapter \
#     --ignore=tests/test_fencing_loop.py -p randomly -p xdist -n 3 --dist loadfile --randomly-seed=N \
#     --deselect tests/test_fault_schedules.py::test_fault_schedules    # just the core suite
# The seed fixes the order of the modules and of the tests in each; which worker gets which module
# still depends on timing, so if the failure does not come back with -n, run the same seed in one
# process (-p no:xdist instead of -p xdist -n 2): every module then runs after all the modules that
# ran before it in its worker (tests/README.md says more).  -p randomly is explicit, so the order is
# random even with plugin autoloading off.
# The other suites keep their fixed order (-p no:randomly): the fault checker draws its own seeded
# schedules, and the framework suites run their modules in one process each.
seed=${CKPT_TEST_SEED:-$(( (RANDOM << 15 | RANDOM) % 1000000000 ))}
fixed=(-p no:randomly)
# The core suite in 3-5 worker processes (pytest-xdist), a test module per worker at a time: much
# of it waits on subprocesses and the local servers, so more workers than cores keep them busy.
# Each worker starts its own servers (session fixtures).  It runs every test, the slow ones too
# (a developer's quick run deselects them with -m "not slow": see tests/README.md).
# test_fencing_loop.py (three stores, about 75 s each, writers paused with SIGSTOP: the test mostly
# waits) runs beside the framework suites instead (below): in the core suite, when the random
# order put it last, its worker alone went on for minutes with the CPU idle.
suite core tests --ignore=tests/keras_adapter --ignore=tests/paddle_adapter --ignore=tests/torch_adapter --ignore=tests/jax_adapter -p randomly -p xdist \
  -n "$workers" --dist loadfile --randomly-seed="$seed" \
  --ignore=tests/test_fencing_loop.py \
  --deselect tests/test_fault_schedules.py::test_fault_schedules "${@}"
# The fault-schedule checker (10,000 seeded schedules, tests/_faults.py) in a run of its own: it
# spreads them over a process per core itself, and its time is part of what it promises.
suite faults tests/test_fault_schedules.py::test_fault_schedules -s "${fixed[@]}" "${@}"
# Docstring examples of the core and the framework-free NumPy adapter, in a run of their own:
# --doctest-modules over tests/ would import the framework test helpers (Keras and Paddle in one
# process).  ckptcore/testing.py is the conformance suite that adapters' tests subclass, not docs.
suite doctests ckptcore adapters/ckptcore_numpy --doctest-modules --ignore=ckptcore/testing.py \
  "${fixed[@]}" "${@}"
# The four frameworks' suites run at the same time, each in its own process (their tests wait on
# subprocesses and servers much of the time), their lines prefixed with the suite's name.
for fw in paddle keras torch jax; do
  [ -d "tests/${fw}_adapter" ] && PREFIX=1 suite "$fw" "tests/${fw}_adapter" "${fixed[@]}" "$@" &
done
# The fencing storm beside them: a worker per store (they wait on paused writers, not the CPU).
PREFIX=1 suite fencing tests/test_fencing_loop.py "${fixed[@]}" -p xdist -n 3 "$@" &
wait

echo
passed=0; failed=0
for name in core faults doctests paddle keras torch jax fencing; do
  [ -f "$logs/$name.rc" ] || continue
  read -r rc secs < "$logs/$name.rc"
  line=$(grep -E '[0-9]+ (passed|failed|deselected)|no tests ran' "$logs/$name.log" | tail -n 1 \
         | sed 's/=//g; s/^ *//; s/ *$//' || true)
  printf 'suite %-9s exit %d in %dm%02ds: %s\n' "$name" "$rc" $((secs / 60)) $((secs % 60)) \
    "${line:-no summary}"
  passed=$((passed + $(echo "$line" | awk '{for (i = 2; i <= NF; i++) if ($i ~ /^passed/) n += $(i-1)} END {print n + 0}')))
  failed=$((failed + $(echo "$line" | awk '{for (i = 2; i <= NF; i++) if ($i ~ /^(failed|errors?)/) n += $(i-1)} END {print n + 0}')))
  # pytest's exit 5 means "no tests collected": not a failure for an optional group
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=1; fi
done
[ -f "$logs/faults.log" ] && grep -h "^FAULT SCHEDULES" "$logs/faults.log" || true
# The core suite's order, from its log (the header line pytest-randomly wrote), and how to replay it.
order=$(grep -h -m 1 -o 'Using --randomly-seed=[0-9]*' "$logs/core.log" 2>/dev/null \
        || echo "Using --randomly-seed=$seed")
echo "core order: $order (replay: CKPT_TEST_SEED=${order##*=} scripts/test.sh)"
echo "total: $passed passed, $failed failed"
exit $status

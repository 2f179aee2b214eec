#!/usr/bin/env bash
# Runs every benchmark of this folder one after another, each in its own Python process (the
# scripts keep TensorFlow and Paddle in separate processes themselves), with its default
# settings: each appends its section to benchmarks/RESULTS.md.
#
#   benchmarks/run_all.sh            # the full set (expect 20 minutes or more)
#   benchmarks/run_all.sh --quick    # smoke run: --quick where a script has it, nothing recorded
#
# PYTHON picks the interpreter (default: python3). PEERS_PYTHON (default: PYTHON) runs
# bench_peers.py and bench_models_jax.py and is bench_scaling.py's Orbax worker
# (CKPT_ORBAX_PYTHON): a Python with the `bench` extra (torch, orbax-checkpoint, jax; optax for
# bench_models_jax.py); the test venv has them too (the [jax] extra; see README.md); without
# Orbax there, its contender is skipped with the reason printed. A failing
# benchmark does not stop the others; the failures are listed at the end and make the exit status
# non-zero.
set -u

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
python="${PYTHON:-python3}"
peers_python="${PEERS_PYTHON:-$python}"
export CKPT_ORBAX_PYTHON="${CKPT_ORBAX_PYTHON:-$peers_python}"
# Run from a checkout as well as from an installed ckptcore: the checkout comes first.
export PYTHONPATH="$root:$root/adapters${PYTHONPATH:+:$PYTHONPATH}"

quick=0
case "${1:-}" in
  --quick) quick=1 ;;
  "") ;;
  *) echo "usage: $0 [--quick]" >&2; exit 2 ;;
esac

benchmarks=(
  bench_save_load.py
  bench_scaling.py
  bench_models_keras.py
  bench_models_paddle.py
  bench_models_torch.py
  bench_models_jax.py
  bench_peers.py
  bench_s3.py
  bench_keras.py
  bench_paddle.py
  bench_async.py
  bench_dist.py
  bench_backup.py
  bench_scale_sim.py
  bench_memory.py
  bench_history.py
)

# --quick for the scripts that lack it: their own options for a small, short run.
declare -A quick_args=([bench_async.py]="--size-mb 64 --rounds 2")
# The interpreter of the scripts that need the peers' environment.
declare -A interpreter=([bench_peers.py]="$peers_python" [bench_models_jax.py]="$peers_python")

failed=()
for name in "${benchmarks[@]}"; do
  script="$here/$name"
  if [[ ! -f "$script" ]]; then
    echo "=== $name: not in this checkout, skipped"
    continue
  fi
  args=()
  py="${interpreter[$name]:-$python}"
  if (( quick )); then
    # Not every script has --quick (see quick_args); every run is kept out of RESULTS.md.
    help="$("$py" "$script" --help 2>/dev/null)"
    if [[ "$help" == *--quick* ]]; then
      args+=(--quick)
    elif [[ -n "${quick_args[$name]:-}" ]]; then
      read -r -a more <<< "${quick_args[$name]}"
      args+=("${more[@]}")
    fi
    [[ "$help" == *--no-record* ]] && args+=(--no-record)
  fi
  echo "=== $name ${args[*]:-}"
  start=$SECONDS
  if "$py" "$script" "${args[@]}"; then
    echo "=== $name: done in $((SECONDS - start)) s"
  else
    echo "=== $name: FAILED (exit $?) after $((SECONDS - start)) s"
    failed+=("$name")
  fi
done

if (( ${#failed[@]} )); then
  echo "failed: ${failed[*]}"
  exit 1
fi
echo "all benchmarks ran"

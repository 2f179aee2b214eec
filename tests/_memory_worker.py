"""One memory measurement of ``test_memory_bounds.py``, in a fresh interpreter (its own peak).

    python _memory_worker.py '<json spec>'

The spec: ``case`` (``s3_save``, ``async_save``, ``restore``, ``budget``), ``mib`` (the state's
size), ``url``, ``opts`` (storage options), ``knobs`` (set with ``_knobs.override`` for the whole
run).  The state is 16 float32 arrays (plus ``small`` tiny ones, gathered into parts on S3),
each a pattern rebuilt exactly from its index.  The worker warms the code path up on a tiny
state (imports, the S3 client), resets its peak (``/proc/self/clear_refs``), reads ``VmRSS``,
runs the case, reads ``VmHWM``, and prints one JSON line: ``peak`` (bytes above the RSS before
the case), ``state`` (the state's bytes) and the knobs as the library read them; ``{"skip":
...}`` where the kernel cannot reset the peak.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import numpy as np

import ckptcore
from ckptcore import _knobs

ARRAYS = 16


def pattern(n: int, salt: int) -> np.ndarray:
    a = np.arange(n, dtype=np.uint32)
    a *= 2654435761 + 2 * salt
    return a.view(np.float32)


def make_state(total: int, small: int = 0) -> ckptcore.TrainingState:
    n = max(1, total // 4 // ARRAYS)
    model = {f"t{i:02d}": pattern(n, i) for i in range(ARRAYS)}
    model.update({f"small/{i:05d}": pattern(1024, 100 + i) for i in range(small)})
    return ckptcore.TrainingState(model=model, step=1)


def check(state: ckptcore.TrainingState, total: int, small: int = 0) -> None:
    n = max(1, total // 4 // ARRAYS)
    for i in range(ARRAYS):
        got = state.model[f"t{i:02d}"]
        if not np.array_equal(got.view(np.uint32), pattern(n, i).view(np.uint32)):
            raise SystemExit(f"t{i:02d}: the checkpoint does not hold the saved bytes")
    for i in range(small):
        if not np.array_equal(state.model[f"small/{i:05d}"], pattern(1024, 100 + i)):
            raise SystemExit(f"small/{i:05d}: the checkpoint does not hold the saved bytes")


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
        return True
    except OSError:
        return False


def measure(fn) -> int:
    gc.collect()
    if not reset_peak():
        print(json.dumps({"skip": "this kernel refuses /proc/self/clear_refs"}))
        sys.exit(0)
    before = status("VmRSS")
    fn()
    return status("VmHWM") - before


def run(spec: dict) -> dict:
    total, small = int(spec["mib"]) << 20, int(spec.get("small", 0))
    url, opts, case = spec["url"], spec.get("opts") or {}, spec["case"]
    out: dict = {"state": total + small * 4096,
                 "knobs": {"remote_part_size": _knobs.remote_part_size(),
                           "remote_concurrency": _knobs.remote_concurrency(),
                           "staging_bytes": _knobs.staging_bytes()}}
    tiny = make_state(ARRAYS * 4096)
    if case == "s3_save":
        state = make_state(total, small)
        ckptcore.save_state(f"{url}-warmup", tiny, storage_options=opts)
        out["peak"] = measure(lambda: ckptcore.save_state(url, state, storage_options=opts))
    elif case == "restore":
        ckptcore.load_state(spec["warmup"], storage_options=opts)
        got = []
        out["peak"] = measure(lambda: got.append(ckptcore.load_state(url, storage_options=opts)))
        check(got[0], total, small)
    elif case in ("async_save", "budget"):
        out.update(async_save(url, make_state(total), tiny, mutate=case == "budget"))
    else:
        raise SystemExit(f"unknown case {case!r}")
    return out


def async_save(root: str, state: ckptcore.TrainingState, tiny: ckptcore.TrainingState, *,
               mutate: bool) -> dict:
    """An async save's peak; with ``mutate``, every array of the caller's is overwritten the
    moment ``save()`` returns, and the checkpoint must still hold the bytes of the call."""
    with ckptcore.CheckpointManager(os.path.join(root, "warmup"), async_save=True,
                                    save_on_preemption=False) as warm:
        warm.save(0, tiny).result()
    mgr = ckptcore.CheckpointManager(root, async_save=True, save_on_preemption=False)
    done = []

    def save() -> None:
        handle = mgr.save(1, state)
        done.append(handle.done())
        if mutate:
            for a in state.model.values():
                a.fill(-1.0)  # training goes on at once
        handle.result()

    peak = measure(save)
    mgr.close()
    check(ckptcore.load_state(mgr.step_url(1)), sum(a.nbytes for a in state.model.values()))
    return {"peak": peak, "done_at_return": done[0]}


def main() -> None:
    spec = json.loads(sys.argv[1])
    with _knobs.override(**spec.get("knobs", {})):
        out = run(spec)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

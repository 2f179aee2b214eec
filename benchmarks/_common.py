"""Helpers shared by the benchmark driver and its subprocess workers.

Nothing here imports ckptcore or a framework, so the TensorFlow and Paddle
workers stay free of each other (importing TensorFlow before Paddle in one
process segfaults).
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import time
from typing import Callable, Iterable

import numpy as np

DROP_CACHES = "/proc/sys/vm/drop_caches"


# ------------------------------------------------------------------------------------ the states
def large_shapes(size_mb: float) -> list[tuple[str, str, tuple[int, int]]]:
    """Four square float32 weights, each with Adam ``m`` and ``v`` slots: ``(param, slot, shape)``.

    ``size_mb=768`` gives 4096x4096 (the default ~800 MB state); other sizes scale the side.
    """
    side = max(8, int(round(math.sqrt(size_mb * 2**20 / (12 * 4)))))
    return [(f"layer{i}/kernel", slot, (side, side)) for i in range(4) for slot in ("w", "m", "v")]


def small_shapes(count: int) -> list[tuple[int, ...]]:
    """``count`` small float32 tensor shapes (biases, norms, tiny kernels): ~1.2 KB on average."""
    cycle = [(64,), (256,), (16, 16), (1024,), (3, 3, 8), (128,)]
    return [cycle[i % len(cycle)] for i in range(count)]


def fill(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random-looking float32 data (incompressible, so no backend gains from zero pages)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal(size=shape, dtype=np.float32)


def large_state(size_mb: float):
    """The default benchmark state: ``model`` weights plus Adam ``m``/``v`` slots."""
    import ckptcore

    shapes = large_shapes(size_mb)
    arrays = {(p, s): fill(shape, seed=i) for i, (p, s, shape) in enumerate(shapes)}
    params = sorted({p for p, _, _ in shapes})
    return ckptcore.TrainingState(
        model={p: arrays[p, "w"] for p in params},
        optimizer=ckptcore.OptimizerState(
            kind="adam", step=1000, hyperparams={"lr": 1e-3, "beta1": 0.9, "beta2": 0.999},
            slots={p: {"m": arrays[p, "m"], "v": arrays[p, "v"]} for p in params}),
        step=1000, epoch=3)


def small_state(count: int):
    """A state of ``count`` small tensors in ``model``."""
    import ckptcore

    return ckptcore.TrainingState(
        model={f"block{i // 100}/t{i}": fill(shape, seed=i)
               for i, shape in enumerate(small_shapes(count))}, step=1)


def flat_arrays(state) -> dict[str, np.ndarray]:
    """All of a state's arrays under flat ``.``-joined names (for savez, safetensors, raw files)."""
    out = {"model." + k.replace("/", "."): v for k, v in state.model.items()}
    if state.optimizer is not None:
        for p, slots in state.optimizer.slots.items():
            for s, a in slots.items():
                out[f"optimizer.{p.replace('/', '.')}.{s}"] = a
    return out


def touch(arr: np.ndarray) -> int:
    """Read one byte of every 4 KiB page, so lazily mapped data must really be in memory."""
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return int(flat[::4096].sum(dtype=np.uint64)) if flat.size else 0


# ------------------------------------------------------------------------------------ cold cache
def cache_method() -> str:
    """``"drop_caches"`` if we may write ``/proc/sys/vm/drop_caches`` (root), else ``"fadvise"``."""
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        return "fadvise"


def files_under(paths: Iterable[str]) -> list[str]:
    out = []
    for p in paths:
        if os.path.isdir(p):
            for root, _, names in os.walk(p):
                out += [os.path.join(root, n) for n in names]
        elif os.path.exists(p):
            out.append(p)
    return out


def fsync_paths(paths: Iterable[str]) -> None:
    """fsync every file under ``paths``: contenders that do not fsync themselves pay for it here."""
    for name in files_under(paths):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def evict(paths: Iterable[str], method: str) -> None:
    """Make the next read of ``paths`` come from the disk, by the same method for every contender
    (``"none"``: leave the cache alone, for tmpfs)."""
    if method == "none":
        return
    if method == "drop_caches":
        os.sync()
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
        return
    for name in files_under(paths):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)  # DONTNEED only drops clean pages
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def clean(path: str) -> None:
    """Remove an output and flush the deletion, so it does not bleed into the next timing."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)
    os.sync()


# ---------------------------------------------------------------------------------------- timing
def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def summary(times: list[float]) -> dict:
    return {"median": statistics.median(times), "best": min(times), "all": times}


def cell(s: dict) -> str:
    """A table cell for a ``summary``: the median and [best-worst], in seconds."""
    return f"{s['median']:.3f} [{s['best']:.3f}-{max(s['all']):.3f}]"


def vm_status(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------- scaling-sweep states
def sweep_sizes(dist: str, count: int, total_mb: float) -> list[int]:
    """Element counts of ``count`` float32 tensors totalling about ``total_mb`` MiB.

    ``"equal"``: all the same size (the tensor-count sweep: only the count changes).
    ``"mixed"``: log-uniform sizes spanning 1 to 4096 (relative), in a fixed shuffled order, like
    a network's biases, norms and kernels side by side (the state-size sweep: the largest tensor
    is about 4% of the state, the smallest a few elements at 1 MiB).
    """
    elems = int(total_mb * 2**20) // 4
    if dist == "equal":
        return [max(1, elems // count)] * count
    if dist != "mixed":
        raise ValueError(dist)
    weights = np.geomspace(1.0, 4096.0, count)
    np.random.default_rng(count).shuffle(weights)
    sizes = np.maximum(1, np.round(weights / weights.sum() * elems)).astype(np.int64)
    sizes[int(np.argmax(sizes))] += elems - int(sizes.sum())  # exact total
    return [int(n) for n in sizes]


def sweep_arrays(sizes: list[int], seed: int = 0) -> list[np.ndarray]:
    """Incompressible float32 arrays of ``sizes`` elements, each its own allocation (as a
    framework's tensors are), the same for the same arguments in every process."""
    rng = np.random.default_rng(seed)
    arrays = [np.empty(n, np.float32) for n in sizes]
    for a in arrays:
        rng.random(dtype=np.float32, out=a)
    return arrays


def touch_mapped(arrays: Iterable[np.ndarray]) -> int:
    """:func:`touch` every buffer behind ``arrays`` that NumPy did not allocate (a mapped file,
    bytes), once per buffer: lazily mapped data must really be in memory, and arrays in NumPy's
    own memory were filled by their reader already. One cheap pass per array, so a result of
    30,000 views of one mapping pays for one touch, not 30,000."""
    owners: dict[int, object] = {}
    for a in arrays:
        b = a
        while isinstance(b, np.ndarray) and b.base is not None:
            b = b.base
        if isinstance(b, np.ndarray):
            continue
        owner = b.obj if isinstance(b, memoryview) else b
        owners.setdefault(id(owner), owner)
    total = 0
    for owner in owners.values():
        total += touch(np.frombuffer(owner, np.uint8))
    return total


def spread(times: list[float]) -> dict:
    """Median, min and max of a point's rounds (and the rounds themselves)."""
    return {"median": statistics.median(times), "min": min(times), "max": max(times),
            "all": times}


def free_ports(n: int) -> list[int]:
    """``n`` TCP ports free on 127.0.0.1 now (servers and the ranks of a job)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports

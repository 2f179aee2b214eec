"""Helpers shared by the test suites: exact comparison of states, the sample states, free ports.

One home for each kind of helper the tests had written several times (tests/README.md lists them):

* states: :func:`sample_state` (every section), :func:`make_state` (a small model and an Adam
  slot whose values depend on the step; :func:`assert_state_of` checks one), :func:`tiny_state`
  (one float32 tensor holding the step), :func:`finetune_state` (a large frozen backbone and a
  small head that changes every step, for the backup tier);
* ports: :func:`free_port`, :func:`free_ports`, :func:`dead_s3_options` (an S3 endpoint nobody
  listens on).
"""

from __future__ import annotations

import functools
import math
import os
import socket
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np

import ckptcore
from ckptcore import AccumulationState, OptimizerState, ParamInfo, ScheduleState, TrainingState


def le_contiguous(a: np.ndarray) -> np.ndarray:
    """What ckptcore must hand back for ``a``: C-contiguous, little-endian, the same bits.

    Uses ``byteswap`` (which knows complex and string layouts) rather than the ``astype`` the
    library uses, so the expectation is computed independently.
    """
    a = np.array(a, copy=True, order="C")
    if a.dtype.byteorder == ">":
        a = a.byteswap().view(a.dtype.newbyteorder("<"))
    return a


def assert_array_same(got: Any, want: np.ndarray, where: str = "") -> None:
    """Bit-for-bit equality (NaNs, -0.0, padding bytes and all) of ``got`` with ``want``."""
    assert isinstance(got, np.ndarray), f"{where}: expected ndarray, got {type(got).__name__}"
    want = le_contiguous(want)
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
    assert got.dtype.byteorder in "=|<", f"{where}: not little-endian: {got.dtype}"
    assert got.shape == want.shape, f"{where}: shape {got.shape} != {want.shape}"
    assert got.tobytes() == want.tobytes(), f"{where}: bytes differ"


def assert_tree_same(got: Any, want: Any, where: str = "state") -> None:
    """Exact structural equality: container types, key order and types, value types and bits."""
    if isinstance(want, np.ndarray):
        assert_array_same(got, want, where)
        return
    if isinstance(want, np.generic):
        assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
        assert_array_same(np.asarray(got), np.asarray(want), where)
        return
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        assert [(type(k), k) for k in got] == [(type(k), k) for k in want], \
            f"{where}: keys {list(got)!r} != {list(want)!r}"
        for k in want:
            assert_tree_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_tree_same(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert struct.pack("<d", got) == struct.pack("<d", want) or (
            math.isnan(got) and math.isnan(want)), f"{where}: {got!r} != {want!r}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def assert_state_same(got: TrainingState, want: TrainingState, sections=TrainingState.SECTIONS) -> None:
    for name in sections:
        g, w = getattr(got, name), getattr(want, name)
        if name == "params":
            assert g == w, "state.params differ"
        elif isinstance(w, (OptimizerState, ScheduleState, AccumulationState)):
            assert type(g) is type(w), f"state.{name}: {type(g).__name__} != {type(w).__name__}"
            assert_tree_same(vars(g), vars(w), f"state.{name}")
        else:
            assert_tree_same(g, w, f"state.{name}")


def sample_state(seed: int = 0, *, scale: int = 1) -> TrainingState:
    """A deterministic state using every section; ``scale`` grows the weights (scale 1 ~ 40 KB)."""
    rng = np.random.default_rng(seed)
    n = 32 * scale
    model = {
        "dense/kernel": rng.standard_normal((n, 64), dtype=np.float32),
        "dense/bias": rng.standard_normal(64).astype(np.float16),
        "bn/moving_mean": rng.standard_normal(64),
        "embed/table": rng.integers(-100, 100, (n, 16), dtype=np.int64),
        "count": np.array(seed, dtype=np.int32),
    }
    slots = {k: {"m": np.zeros_like(v) + 1, "v": np.full_like(v, 2)}
             for k, v in model.items() if v.dtype.kind == "f"}
    return TrainingState(
        model=model,
        optimizer=OptimizerState("adam", step=seed + 3, hyperparams={"lr": 1e-3, "betas": (0.9, 0.999)},
                                 slots=slots, extra={"loss_scale": np.float32(128.0)}),
        schedule=ScheduleState("cosine", config={"warmup": 10, "total": 1000}, step=seed, last_lr=5e-4,
                               state={"best": np.float32(0.25)}),
        rng={"python": (3, tuple(range(5)), None), "numpy": {"state": np.arange(4, dtype=np.uint64)}},
        data={"epoch": 1, "position": seed * 7, "seed": 1234},
        accumulation=AccumulationState(every=4, count=2, buffers={"dense/kernel": model["dense/kernel"] * 0.5}),
        step=seed, epoch=seed // 10, framework="numpy",
        metadata={"note": "sample", "versions": {"numpy": "x"}},
        extra={"history": [1.0, 0.5, float("nan")], "blob": b"\x00\x01"},
        params={"dense/kernel": ParamInfo(index=0, layer="dense", kind="dense", role="kernel", layout="io")},
    )


def make_state(step: int, *, scale: int = 1) -> TrainingState:
    """A deterministic state for ``step``: every array's values depend on the step."""
    kernel = (np.arange(4096 * scale, dtype=np.float32) + step).reshape(64 * scale, 64)
    return TrainingState(
        model={"dense/kernel": kernel, "dense/bias": np.full(1024, step, dtype=np.int64)},
        optimizer=OptimizerState("adam", step=step, hyperparams={"lr": 1e-3},
                                 slots={"dense/kernel": {"m": kernel * 0.5}}),
        step=step, metadata={"note": f"state of step {step}"})


def assert_state_of(state: TrainingState, step: int) -> None:
    """``state`` is exactly ``make_state(step)`` (arrays bit for bit)."""
    want = make_state(step)
    assert state.step == step, (state.step, step)
    for name, arr in want.model.items():
        got = state.model[name]
        assert got.dtype == arr.dtype and got.shape == arr.shape, (name, got.dtype, got.shape)
        assert np.array_equal(got, arr), f"step {step}: {name} differs"
    got_m = state.optimizer.slots["dense/kernel"]["m"]
    assert np.array_equal(got_m, want.optimizer.slots["dense/kernel"]["m"]), f"step {step}: slot m"


def tiny_state(step: int = 1, *, n: int = 1000, **sections: Any) -> TrainingState:
    """One float32 tensor ``w`` of ``n`` values, each equal to ``step``; ``sections``: the rest of
    the state (``metadata=...``, ``data=...``)."""
    return TrainingState(model={"w": np.full(n, step, np.float32)}, step=step, **sections)


@functools.lru_cache(maxsize=None)
def frozen_backbone() -> np.ndarray:
    """The frozen part of :func:`finetune_state`: 450,000 float32 values (1.8 MB, one chunk),
    the same in every call (do not modify it)."""
    return np.random.default_rng(0).standard_normal(450_000).astype(np.float32)


def finetune_state(step: int, *, tuned: int = 50_000) -> TrainingState:
    """A fine-tuning state: 90% of the parameter bytes frozen (the backbone), the head changing
    every step, trained with plain SGD (no slots: an optimizer's slots of the trainable part
    change every step too, and are uploaded every step)."""
    head = np.random.default_rng(step).standard_normal(tuned).astype(np.float32)
    return TrainingState(model={"backbone": frozen_backbone(), "head": head},
                         optimizer=OptimizerState("sgd", step=step, hyperparams={"lr": 0.01}),
                         data={"epoch": 0, "position": step}, step=step)


def same_finetune(a: TrainingState, b: TrainingState) -> bool:
    """``a`` and ``b`` (states of :func:`finetune_state`) hold the same step, data and bytes."""
    return (a.step == b.step and a.data == b.data and a.optimizer.step == b.optimizer.step
            and all(a.model[k].tobytes() == b.model[k].tobytes() for k in b.model))


CLOUD = ("s3", "gcs", "azure")


def store_params(*names: str) -> list:
    """Parameters of a fixture that picks a storage backend by name: the object stores (real
    local servers, a test on one takes seconds) marked ``slow``, so that ``-m "not slow"`` runs
    on local disk and ``memory://`` only, and the full run on every store."""
    import pytest  # here, not at the top: the workers that import this module need no pytest
    return [pytest.param(n, marks=pytest.mark.slow) if n in CLOUD else n for n in names]


def save_and_reload(url: str, state: TrainingState, **kw: Any) -> TrainingState:
    ckptcore.save_state(url, state, **kw)
    return ckptcore.load_state(url, **kw)


# The environment of a test's subprocess: the repository importable, the frameworks quiet.
REPO = Path(__file__).resolve().parents[1]


def subprocess_env(here: Path | str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO), str(REPO / "adapters")] + ([str(here)] if here else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    env.setdefault("GLOG_minloglevel", "3")
    return env


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 now (for the ranks of a multi-process job)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a local server)."""
    return free_ports(1)[0]


def dead_s3_options(*, read_timeout: float = 1, key: str = "testing",
                    secret: str = "testing") -> dict[str, Any]:
    """s3fs storage options of an S3 endpoint on a port nobody listens on, failing fast (one
    attempt, 1 s to connect) and never sharing a cached filesystem instance."""
    return {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}"},
            "key": key, "secret": secret, "skip_instance_cache": True,
            "config_kwargs": {"connect_timeout": 1, "read_timeout": read_timeout,
                              "retries": {"max_attempts": 1}}}


def run_ranks(groups: list, fn: Any, *, timeout: float = 120) -> dict[int, Any]:
    """``fn(group)`` on one thread per rank of a ``ckptcore.ThreadGroup``: ``{rank: result or
    the exception it raised}``; fails the test if a rank is still running after ``timeout``."""
    out: dict[int, Any] = {}

    def body(g: Any) -> None:
        try:
            out[g.rank] = fn(g)
        except BaseException as e:  # returned for the test to compare
            out[g.rank] = e

    threads = [threading.Thread(target=body, args=(g,), daemon=True) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    hung = [g.rank for g, t in zip(groups, threads) if t.is_alive()]
    assert not hung, f"ranks {hung} hung; the others returned {out!r}"
    return out

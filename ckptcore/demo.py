"""``ckpt demo``: train a tiny model, SIGKILL it mid-epoch, resume it, and show the resumed run
equals an uninterrupted one, bit for bit.

The training job runs in a child process (``python -m ckptcore.demo worker ...``) that saves
through a :class:`CheckpointManager` every few steps and reports each batch it trains on.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Any, Callable

import numpy as np

from . import CheckpointManager, DataCursor, OptimizerState, TrainingState, capture_rng, restore_rng

N, FEATURES, CLASSES, BATCH, EPOCHS, SAVE_EVERY, SEED = 512, 8, 3, 32, 3, 5, 7


def _data() -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(SEED)
    x = g.standard_normal((N, FEATURES)).astype(np.float32)
    y = (x @ g.standard_normal((FEATURES, CLASSES)).astype(np.float32)).argmax(1)
    return x, y


def _step(w, b, vel, x, y, noise, lr=np.float32(0.1), mu=np.float32(0.9)):
    """One SGD-momentum step of softmax regression on a noisy (augmented) batch."""
    x = x + noise
    logits = x @ w + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    gw, gb = x.T @ p / np.float32(len(y)), p.mean(0)
    vel["w"] = mu * vel["w"] + gw
    vel["b"] = mu * vel["b"] + gb
    return w - lr * vel["w"], b - lr * vel["b"]


def train(root: str | None, emit: Callable[[int, np.ndarray], None], *, pause_after: int = -1,
          storage_options: dict | None = None) -> TrainingState:
    """Train to the end, resuming from ``root``'s newest checkpoint if there is one."""
    x, y = _data()
    cursor = DataCursor(N, BATCH, seed=SEED)
    aug = np.random.default_rng(123)  # augmentation noise: its RNG state is part of the checkpoint
    w = np.zeros((FEATURES, CLASSES), np.float32)
    b = np.zeros(CLASSES, np.float32)
    vel = {"w": np.zeros_like(w), "b": np.zeros_like(b)}
    step = 0
    mgr = CheckpointManager(root, keep=3, storage_options=storage_options) if root else None
    if mgr is not None and mgr.latest_step() is not None:
        st = mgr.restore(cursor=cursor)
        w, b, step = st.model["w"], st.model["b"], st.step
        vel = {k: st.optimizer.slots[k]["momentum"] for k in ("w", "b")}
        restore_rng(st.rng, generators={"aug": aug})
    while cursor.epoch < EPOCHS:
        idx = cursor.next_batch()
        noise = aug.standard_normal((len(idx), FEATURES)).astype(np.float32) * np.float32(0.1)
        w, b = _step(w, b, vel, x[idx], y[idx], noise)
        step += 1
        emit(step, idx)
        state = TrainingState(
            model={"w": w, "b": b}, step=step, epoch=cursor.epoch,
            optimizer=OptimizerState("sgd", step, {"learning_rate": 0.1, "momentum": 0.9},
                                     {k: {"momentum": v} for k, v in vel.items()}),
            rng=capture_rng(python=False, numpy=False, generators={"aug": aug}))
        if mgr is not None and step % SAVE_EVERY == 0:
            mgr.save(step, state, cursor=cursor)
        if step == pause_after:
            signal.pause()  # wait here to be killed, mid-epoch
    if mgr is not None:
        if step % SAVE_EVERY:
            mgr.save(step, state, cursor=cursor)  # the final state, for the comparison
        mgr.close()
    return state


def _framework_setup(framework: str):
    """A tiny MLP with Dropout and Adam in Keras or Paddle: ``(objects, train_step)``."""
    x, y = _data()
    if framework == "keras":
        os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import keras
        import tensorflow as tf
        keras.utils.set_random_seed(SEED)
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dropout(0.2), keras.layers.Dense(CLASSES)])
        opt = keras.optimizers.Adam(0.01)
        opt.build(model.trainable_variables)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        def step(idx):
            with tf.GradientTape() as tape:
                loss = loss_fn(y[idx], model(x[idx], training=True))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))
        return {"model": model, "optimizer": opt}, step
    import paddle
    paddle.seed(SEED)
    net = paddle.nn.Sequential(paddle.nn.Linear(FEATURES, 16), paddle.nn.ReLU(),
                               paddle.nn.Dropout(0.2), paddle.nn.Linear(16, CLASSES))
    opt = paddle.optimizer.Adam(learning_rate=0.01, parameters=net.parameters())

    def step(idx):
        loss = paddle.nn.functional.cross_entropy(net(paddle.to_tensor(x[idx])),
                                                  paddle.to_tensor(y[idx].astype(np.int64)))
        loss.backward()
        opt.step()
        opt.clear_grad()
    return {"model": net, "optimizer": opt}, step


def train_framework(framework: str, root: str, emit: Callable[[int, np.ndarray], None], *,
                    pause_after: int = -1, storage_options: dict | None = None) -> None:
    """The same loop as :func:`train`, with a Keras or Paddle model saved through its adapter."""
    objects, train_step = _framework_setup(framework)
    cursor = DataCursor(N, BATCH, seed=SEED)
    mgr = CheckpointManager(root, keep=3, storage_options=storage_options)
    step = 0
    if mgr.latest_step() is not None:
        step = mgr.restore(cursor=cursor, **objects).step
    while cursor.epoch < EPOCHS:
        idx = cursor.next_batch()
        train_step(idx)
        step += 1
        emit(step, idx)
        if step % SAVE_EVERY == 0:
            mgr.save(step, cursor=cursor, **objects)
        if step == pause_after:
            signal.pause()
    if step % SAVE_EVERY:
        mgr.save(step, cursor=cursor, **objects)
    mgr.close()


def _worker(args: argparse.Namespace) -> int:
    def emit(step: int, idx: np.ndarray) -> None:
        print(json.dumps({"step": step, "batch": idx.tolist()}), flush=True)
    options = json.loads(args.options)
    if args.framework == "numpy":
        train(args.root, emit, pause_after=args.pause_after, storage_options=options)
    else:
        train_framework(args.framework, args.root, emit, pause_after=args.pause_after,
                        storage_options=options)
    return 0


def _run_worker(root: str, options: dict, pause_after: int, framework: str) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "ckptcore.demo", "worker", root, "--options", json.dumps(options),
           "--pause-after", str(pause_after), "--framework", framework]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(json.loads(line))
        if seen[-1]["step"] == pause_after:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    return seen


def run_demo(root: str | None, framework: str = "numpy", storage_options: dict | None = None) -> int:
    from . import api
    if root is not None and root.startswith("memory://"):
        print("ckpt demo: memory:// lives inside one process, and the demo kills a process; "
              "use a folder or a bucket URL", file=sys.stderr)
        return 2
    options = storage_options or {}
    root = (root or tempfile.mkdtemp(prefix="ckpt-demo-")).rstrip("/")
    steps_per_epoch = N // BATCH + (N % BATCH > 0)
    kill_at = steps_per_epoch + steps_per_epoch // 2 - 1  # mid epoch 1, between two checkpoints
    model = {"numpy": "softmax regression in NumPy with SGD momentum and augmentation noise",
             "keras": "a Keras MLP with Dropout and Adam", "paddle": "a Paddle MLP with Dropout and Adam"}
    print(f"ckpt demo: {model[framework]}; {N} samples, batch {BATCH}, {EPOCHS} epochs, "
          f"a checkpoint every {SAVE_EVERY} steps under {root}")
    reference = _run_worker(root + "/reference", options, -1, framework)
    print(f"1. uninterrupted reference run (its own process): {len(reference)} steps")
    killed = _run_worker(root + "/run", options, kill_at, framework)
    mgr = CheckpointManager(root + "/run", storage_options=options, lock=False)
    resume_from = mgr.latest_step()
    print(f"2. training process SIGKILLed at step {kill_at} (epoch 1, batch "
          f"{kill_at - steps_per_epoch} of {steps_per_epoch}); newest checkpoint: step {resume_from}")
    resumed = _run_worker(root + "/run", options, -1, framework)
    final = api.load_state(mgr.step_url(mgr.latest_step()), storage_options=options)
    ref_mgr = CheckpointManager(root + "/reference", storage_options=options, lock=False)
    ref = api.load_state(ref_mgr.step_url(ref_mgr.latest_step()), storage_options=options)
    print(f"3. resumed in a fresh process from step {resume_from}, finished at step {final.step}")
    return _report(reference, killed, resumed, resume_from, ref, final)


def _tensors(state: TrainingState) -> tuple[list[np.ndarray], list[np.ndarray]]:
    slots = state.optimizer.slots if state.optimizer else {}
    return ([state.model[k] for k in sorted(state.model)],
            [slots[p][k] for p in sorted(slots) for k in sorted(slots[p])])


def _report(reference, killed, resumed, resume_from, ref, final) -> int:
    stitched = [r["batch"] for r in killed if r["step"] <= resume_from] + [r["batch"] for r in resumed]
    same_batches = stitched == [r["batch"] for r in reference]
    per_epoch = N // BATCH + (N % BATCH > 0)
    flat = [i for batch in stitched for i in batch]
    perms = all(sorted(flat[e * N:(e + 1) * N]) == list(range(N)) for e in range(EPOCHS))
    (rw, ro), (fw, fo) = _tensors(ref), _tensors(final)
    same_w = len(rw) == len(fw) and all(a.tobytes() == b.tobytes() for a, b in zip(rw, fw))
    same_opt = len(ro) == len(fo) and all(a.tobytes() == b.tobytes() for a, b in zip(ro, fo))
    print(f"   batches: killed run 1..{resume_from} + resumed run {resume_from + 1}..{final.step} "
          f"== reference 1..{len(reference)} ({per_epoch} per epoch): {same_batches}")
    print(f"   every epoch is a permutation of the {N} samples: {perms}")
    print(f"   final weights bitwise equal ({len(fw)} tensors): {same_w}; "
          f"optimizer slots bitwise equal ({len(fo)} tensors): {same_opt}")
    ok = same_batches and perms and same_w and same_opt and len(fw) > 0
    print("RESULT: the resumed run equals the uninterrupted run" if ok else "RESULT: MISMATCH")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptcore.demo")
    sub = p.add_subparsers(dest="verb", required=True)
    w = sub.add_parser("worker")
    w.add_argument("root")
    w.add_argument("--options", default="{}")
    w.add_argument("--pause-after", type=int, default=-1)
    w.add_argument("--framework", default="numpy", choices=["numpy", "keras", "paddle"])
    args = p.parse_args(argv)
    return _worker(args)


if __name__ == "__main__":
    sys.exit(main())

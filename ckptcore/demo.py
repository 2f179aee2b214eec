"""``ckpt demo``: train a tiny model, SIGKILL it mid-epoch, resume it, and show the resumed run
equals an uninterrupted one, bit for bit.

The training job runs in a child process (``python -m ckptcore.demo worker ...``) that saves
through a :class:`CheckpointManager` every few steps and reports each batch it trains on.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any, Callable

import numpy as np

from . import CheckpointManager, DataCursor, TrainingState
from .errors import AdapterNotFoundError, CheckpointError
from .registry import available_adapters, get_adapter

N, FEATURES, CLASSES, BATCH, EPOCHS, SAVE_EVERY, SEED = 512, 8, 3, 32, 3, 5, 7


class DemoWorkerError(RuntimeError):
    """A training worker ended other than the demo planned (it crashed, or finished early)."""


def _data() -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(SEED)
    x = g.standard_normal((N, FEATURES)).astype(np.float32)
    y = (x @ g.standard_normal((FEATURES, CLASSES)).astype(np.float32)).argmax(1).astype(np.int64)
    return x, y


def train(framework: str, root: str, emit: Callable[[int, np.ndarray], None], *,
          pause_after: int = -1, storage_options: dict | None = None,
          describe: Callable[[str], None] = lambda d: None) -> None:
    """Train the framework's demo program to the end, resuming from ``root``'s newest checkpoint.

    The same loop for every framework: the adapter supplies the model, its objects and one
    training step (:meth:`ckptcore.adapter.Adapter.demo`); the loop draws batches from a
    :class:`DataCursor` and saves everything through a :class:`CheckpointManager`.
    """
    program = get_adapter(framework).demo(seed=SEED, features=FEATURES, classes=CLASSES)
    describe(program.description)
    objects = dict(program.objects)
    x, y = _data()
    cursor = DataCursor(N, BATCH, seed=SEED)
    # save_on_preemption is off: the demo kills with SIGKILL, which no handler sees, and the
    # loop shows the plain kill-and-resume story (the README shows save_if_preempted).
    mgr = CheckpointManager(root, keep=3, storage_options=storage_options, save_on_preemption=False)
    step = 0
    if mgr.latest_step() is not None:
        step = mgr.restore(cursor=cursor, **objects).step
    while cursor.epoch < EPOCHS:
        idx = cursor.next_batch()
        program.train_step(x[idx], y[idx])
        step += 1
        emit(step, idx)
        if step % SAVE_EVERY == 0:
            mgr.save(step, cursor=cursor, **objects)
        if step == pause_after:
            signal.pause()  # wait here to be killed, mid-epoch
    if step % SAVE_EVERY:
        mgr.save(step, cursor=cursor, **objects)  # the final state, for the comparison
    mgr.close()


class _Notes(logging.Handler):
    """Passes the worker's warnings on the ``ckptcore`` logger (a lease taken over) to the demo."""

    def emit(self, record: logging.LogRecord) -> None:
        print(json.dumps({"note": record.getMessage()}), flush=True)


def _worker(args: argparse.Namespace) -> int:
    def emit(step: int, idx: np.ndarray) -> None:
        print(json.dumps({"step": step, "batch": idx.tolist()}), flush=True)

    notes = _Notes(logging.WARNING)
    logging.getLogger("ckptcore").addHandler(notes)

    def describe(description: str) -> None:
        print(json.dumps({"description": description}), flush=True)
    train(args.framework, args.root, emit, pause_after=args.pause_after,
          storage_options=json.loads(args.options), describe=describe)
    return 0


def _run_worker(root: str, options: dict, pause_after: int, framework: str,
                notes: list[str] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """Run one training worker; return its model's description and the batches it reported.

    With ``pause_after`` the worker is SIGKILLed once it reports that step; any other ending than
    that kill (or, without ``pause_after``, a clean exit) raises :class:`DemoWorkerError` with the
    worker's exit code and the end of its stderr.
    """
    cmd = [sys.executable, "-m", "ckptcore.demo", "worker", root, "--options", json.dumps(options),
           "--pause-after", str(pause_after), "--framework", framework]
    description, seen, killed = "", [], False
    # stderr to a file, not a pipe: a framework's chatter must not fill a pipe nobody reads yet.
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        for line in proc.stdout:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line a framework printed: not ours
            if not isinstance(record, dict):
                continue
            if "description" in record:
                description = str(record["description"])
            elif "note" in record:
                if notes is not None:
                    notes.append(str(record["note"]))
            elif "step" in record:
                seen.append(record)
                if record["step"] == pause_after:
                    proc.send_signal(signal.SIGKILL)
                    killed = True
                    break
        proc.stdout.close()
        code = proc.wait()
        if (code == -signal.SIGKILL) if killed else (code == 0 and pause_after < 0):
            return description, seen
        err.seek(0)
        tail = "".join(err.readlines()[-15:]).rstrip()
    what = (f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}")
    if code == 0:
        what += f" before reaching step {pause_after}"
    steps = f" (it reported {len(seen)} steps)"
    raise DemoWorkerError(f"the {framework} training worker {what}{steps}"
                          + (f"; the end of its stderr:\n{tail}" if tail else ""))


def run_demo(root: str | None, framework: str = "numpy", storage_options: dict | None = None,
             *, keep: bool = False) -> int:
    """Run the demonstration; 0 when the resumed run equals the uninterrupted one.

    ``root`` (any fsspec URL but ``memory://``) is the demo's own: a previous demo's checkpoints
    under it are removed first, and it is kept afterwards.  Without ``root`` the demo works in a
    new temporary folder, removed at the end unless ``keep`` is true or the demo failed (its
    path is printed then).
    """
    if root is not None and root.startswith("memory://"):
        print("ckpt demo: memory:// lives inside one process, and the demo kills a process; "
              "use a folder or a bucket URL", file=sys.stderr)
        return 2
    try:
        get_adapter(framework)  # a missing adapter is one line here, not a worker's traceback
    except AdapterNotFoundError as e:
        print(f"ckpt demo: {e}", file=sys.stderr)
        return 2
    options = storage_options or {}
    temporary = root is None
    root = (root or tempfile.mkdtemp(prefix="ckpt-demo-")).rstrip("/")
    try:
        code = _demo(root, framework, options)
    except BaseException:
        if temporary:
            print(f"ckpt demo: the demo's checkpoints are kept in {root}", file=sys.stderr)
        raise
    if not temporary:
        print(f"ckpt demo: the checkpoints stay in {root} (a run on the same root starts over)")
    elif keep or code != 0:
        print(f"ckpt demo: the checkpoints are kept in {root} (remove it when done)")
    else:
        shutil.rmtree(root, ignore_errors=True)
        print(f"ckpt demo: removed the temporary folder {root} "
              "(--root DIR keeps the checkpoints in DIR)")
    return code


def _start_over(root: str, options: dict) -> None:
    """The demo owns ``root/reference`` and ``root/run``: a previous demo's steps there are
    rewound (deleted), saying so, so that a second demo on the same root runs the whole story
    again instead of resuming finished runs (whose final save would then collide)."""
    for name in ("reference", "run"):
        mgr = CheckpointManager(f"{root}/{name}", storage_options=options, save_on_preemption=False)
        try:
            steps = mgr.steps()
            if steps:
                mgr.rewind(steps[0])
                print(f"ckpt demo: {root}/{name} held a previous demo's checkpoints "
                      f"(steps {steps[0]}..{steps[-1]}); starting over: removed them")
        finally:
            mgr.close()


def _demo(root: str, framework: str, options: dict) -> int:
    from . import api
    steps_per_epoch = N // BATCH + (N % BATCH > 0)
    kill_at = steps_per_epoch + steps_per_epoch // 2 - 1  # mid epoch 1, between two checkpoints
    try:
        _start_over(root, options)
        # Only a worker builds the model (this process never imports a framework), so the header
        # naming it comes once the first worker has said what it trains.
        description, reference = _run_worker(root + "/reference", options, -1, framework)
        print(f"ckpt demo: {description}; {N} samples, batch {BATCH}, {EPOCHS} epochs, "
              f"a checkpoint every {SAVE_EVERY} steps under {root}")
        print(f"1. uninterrupted reference run (its own process): {len(reference)} steps")
        _, killed = _run_worker(root + "/run", options, kill_at, framework)
        mgr = CheckpointManager(root + "/run", storage_options=options, lock=False,
                                save_on_preemption=False)
        resume_from = mgr.latest_step()
        print(f"2. training process SIGKILLed at step {kill_at} (epoch 1, batch "
              f"{kill_at - steps_per_epoch} of {steps_per_epoch}); newest checkpoint: step {resume_from}")
        notes: list[str] = []
        _, resumed = _run_worker(root + "/run", options, -1, framework, notes)
        for note in notes:  # e.g. the killed process's writer lease, taken over at once
            print(f"   resumed process: {note}")
    except (DemoWorkerError, CheckpointError) as e:
        print(f"ckpt demo: {e}", file=sys.stderr)
        return 1
    final = api.load_state(mgr.step_url(mgr.latest_step()), storage_options=options)
    ref_mgr = CheckpointManager(root + "/reference", storage_options=options, lock=False,
                                save_on_preemption=False)
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
    """``python -m ckptcore.demo run [--root URL] [--framework NAME]`` runs the demo (as ``ckpt
    demo`` does); ``worker`` is the training process the demo starts, kills and resumes."""
    p = argparse.ArgumentParser(prog="python -m ckptcore.demo")
    sub = p.add_subparsers(dest="verb", required=True)
    frameworks = available_adapters()
    r = sub.add_parser("run")
    r.add_argument("--root", default=None)
    r.add_argument("--framework", default="numpy", choices=frameworks)
    r.add_argument("--keep", action="store_true",
                   help="keep the temporary folder (without --root) after a successful demo")
    w = sub.add_parser("worker")
    w.add_argument("root")
    w.add_argument("--options", default="{}")
    w.add_argument("--pause-after", type=int, default=-1)
    w.add_argument("--framework", default="numpy", choices=frameworks)
    args = p.parse_args(argv)
    if args.verb == "run":
        return run_demo(args.root, args.framework, keep=args.keep)
    return _worker(args)


if __name__ == "__main__":
    sys.exit(main())

"""Exact resume with Paddle after a kill or in a new process, bit for bit, on CPU.

All runs are subprocesses of ``_resume.py`` (a fresh process is the point: killed, resumed, or one
of a process group); one module fixture starts them as early as their inputs allow, so
independent runs share the cores:

* a small MNIST CNN on synthetic MNIST-shaped data, Momentum + PolynomialDecay, batch 32, shuffled by
  a ``DataCursor`` through ``ResumableBatchSampler`` and a prefetching ``DataLoader``, 3 epochs:
  (a) resumed in a new process from the end-of-epoch-0 checkpoint; (b) SIGKILLed by this process in
  the middle of epoch 1 (saving asynchronously) and resumed; (c) accumulating gradients over 4
  batches, killed after a checkpoint taken inside a window (2 of 4 micro-batches) and resumed;
* ``paddle.Model.fit`` with ``ckptcore_paddle.Checkpoint``, SIGKILLed mid-epoch and resumed;
* a two-process ``paddle.DataParallel`` job (gloo), killed, resumed by two processes, killed again,
  and finished by one process with the plain model (elastic resume through the sharded cursor).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("paddle", reason="paddlepaddle is not installed")

import ckptcore  # noqa: E402
from _support import free_ports  # noqa: E402

# 1000 CNN samples (32 batches an epoch, the last of 8) rather than the issue's ~2,000: the runs
# below train the CNN for about 14 epochs in all, on CPU.
N_CNN, BS, EPOCHS, N_FIT, DATA_SEED = 1000, 32, 3, 640, 4
PER_EPOCH = -(-N_CNN // BS)
DP_N, DP_BS = 96, 8
TIMEOUT = 600


class Run:
    """A ``_resume.py`` subprocess whose stdout is watched for ``KILL <batch>``."""

    started: list[Run] = []

    def __init__(self, spawn, d: Path, name: str, command: str, *args: str):
        self.name, self.d = name, d
        self.proc = spawn("_resume.py", command, d, *args)
        self.lines: queue.Queue[str] = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self.err.extend, args=(self.proc.stderr,), daemon=True).start()
        Run.started.append(self)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def _fail(self, what: str) -> None:
        tail = "".join(self.err)[-6000:]
        pytest.fail(f"{self.name}: {what}\n--- stderr\n{tail}", pytrace=False)

    def signalled(self) -> int:
        """Wait for ``KILL <batch>`` and return the batch number."""
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                if self.proc.poll() is not None:
                    self._fail(f"exited with {self.proc.returncode} before asking to be killed")
                continue
            if line.startswith("KILL "):
                return int(line.split()[1])
        self._fail("never asked to be killed")

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc.wait(TIMEOUT) != -signal.SIGKILL:
            self._fail(f"expected death by SIGKILL, got exit status {self.proc.returncode}")

    def finish(self) -> None:
        if self.proc.wait(TIMEOUT) != 0:
            self._fail(f"exited with {self.proc.returncode}")




def _dp_job(spawn, d: Path, phase: str) -> tuple[list[Run], int]:
    ports = ",".join(map(str, free_ports(2)))
    ranks = [Run(spawn, d, f"dp_{phase}_{r}", "dp", phase, str(r), ports) for r in range(2)]
    return ranks, ranks[0].signalled()


def _wait_for_step(root: Path, step: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not (root / f"step-{step:012d}" / "manifest.msgpack").exists():
        assert time.monotonic() < deadline, f"{root} never got step {step}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, spawn_python) -> Path:
    d = tmp_path_factory.mktemp("resume")
    try:
        yield _orchestrate(spawn_python, d)
    finally:  # a failed run must not leave victims sleeping
        for r in Run.started:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()
        Run.started.clear()


def _orchestrate(spawn, d: Path) -> Path:
    reference = Run(spawn, d, "reference", "reference")
    victims = {n: Run(spawn, d, f"victim_{n}", "victim", n) for n in ("plain", "accum", "fit")}
    dp_ranks, dp_signal = _dp_job(spawn, d, "first")
    signalled = {}
    for name, v in victims.items():
        signalled[name] = v.signalled()
        v.kill()
    for r in dp_ranks:
        r.kill()
    signalled["dp_first"] = dp_signal
    dp_ranks, signalled["dp_second"] = _dp_job(spawn, d, "second")
    for r in dp_ranks:
        r.kill()
    _wait_for_step(d / "ckpt_ref_plain", PER_EPOCH)
    later = [Run(spawn, d, "resume", "resume"), Run(spawn, d, "elastic", "elastic")]
    for r in [reference, *later]:
        r.finish()
    (d / "signalled.json").write_text(json.dumps(signalled))
    return d


def _json(d: Path, name: str) -> dict:
    return json.loads((d / f"{name}.json").read_text())


def _jsonl(d: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (d / f"{name}.jsonl").read_text().splitlines()]


def _arrays(d: Path, name: str) -> dict[str, np.ndarray]:
    with np.load(d / f"{name}.npz") as z:
        return {k: z[k] for k in z.files}


def _assert_bitwise(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    assert any(k.startswith("slot/") for k in a)  # optimizer accumulators are compared too
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)), f"{k} differs"


def _assert_continues(ref: dict, resumed: dict, first: int, last: int) -> None:
    """Per-batch losses ``first..last`` of the resumed run equal the reference's, bit for bit."""
    expected = {str(g): ref["losses"][str(g)] for g in range(first, last + 1)}
    assert resumed["losses"] == expected
    assert resumed["final_lr"] == ref["final_lr"]


def test_a_resume_from_end_of_epoch_0_in_a_new_process(runs):
    ref, res = _json(runs, "ref_plain"), _json(runs, "resume_a")
    assert res["restored"] == {"batch": PER_EPOCH, "epoch": 1, "position": 0, "accumulation": None}
    assert len(ref["losses"]) == EPOCHS * PER_EPOCH
    _assert_continues(ref, res, PER_EPOCH, EPOCHS * PER_EPOCH - 1)
    _assert_bitwise(_arrays(runs, "ref_plain"), _arrays(runs, "resume_a"))


def test_b_sigkill_in_the_middle_of_epoch_1_then_resume(runs):
    signalled = json.loads((runs / "signalled.json").read_text())
    ref, res = _json(runs, "ref_plain"), _json(runs, "resume_b")
    start = res["restored"]["batch"]
    # The newest committed checkpoint (async saves may have been cut off by the kill) is mid-epoch 1.
    assert signalled["plain"] <= start < 2 * PER_EPOCH and start % PER_EPOCH != 0 and res["restored"]["epoch"] == 1
    victim = _jsonl(runs, "victim_plain")
    assert victim[-1]["batch"] >= start - 1
    assert all(ref["losses"][str(r["batch"])] == r["loss"] for r in victim)  # the victim ran as the reference
    _assert_continues(ref, res, start, EPOCHS * PER_EPOCH - 1)
    _assert_bitwise(_arrays(runs, "ref_plain"), _arrays(runs, "resume_b"))


def test_c_gradient_accumulation_killed_inside_a_window(runs):
    signalled = json.loads((runs / "signalled.json").read_text())
    ref, res = _json(runs, "ref_accum"), _json(runs, "resume_c")
    start = res["restored"]["batch"]
    assert start == signalled["accum"] and start % 4 == 2 and res["restored"]["epoch"] == 1
    every, count, buffers = res["restored"]["accumulation"]
    assert (every, count) == (4, 2) and "conv1.weight" in buffers and "fc.bias" in buffers
    _assert_continues(ref, res, start, EPOCHS * PER_EPOCH - 1)
    _assert_bitwise(_arrays(runs, "ref_accum"), _arrays(runs, "resume_c"))


def test_fit_with_checkpoint_callback_killed_and_resumed(runs):
    per_epoch = -(-N_FIT // BS)
    ref, res = _json(runs, "ref_fit"), _json(runs, "resume_fit")
    start = res["restored"]["batch"]
    assert per_epoch < start < 2 * per_epoch and start % 5 == 0, start
    assert res["initial_epoch"] == 1 and res["restored"]["data"]["position"] == (start - per_epoch) * BS
    assert ref["restored"] is None and sorted(map(int, ref["losses"])) == list(range(EPOCHS * per_epoch))
    assert res["cursor"] == [EPOCHS, 0] and res["stop_training"] is False
    _assert_continues(ref, res, start, EPOCHS * per_epoch - 1)
    _assert_bitwise(_arrays(runs, "ref_fit"), _arrays(runs, "resume_fit"))
    # The uninterrupted fit saved every 5 batches, at each epoch end and at the end (step 60).
    steps = ckptcore.CheckpointManager(str(runs / "ckpt_ref_fit"), lock=False).steps()
    assert steps == sorted(set(range(5, EPOCHS * per_epoch + 1, 5)))


def _global_batches(seed: int = DATA_SEED) -> list[list[int]]:
    cursor = ckptcore.DataCursor(DP_N, DP_BS, seed=seed)
    return [b.tolist() for _ in range(EPOCHS) for b in cursor.iter_epoch()]


def test_data_parallel_two_processes_then_elastic_one(runs):
    signalled = json.loads((runs / "signalled.json").read_text())
    first, second = signalled["dp_first"], signalled["dp_second"]
    rows = {(p, r): _jsonl(runs, f"dp_{p}_rank{r}") for p in ("first", "second") for r in (0, 1)}
    elastic = _json(runs, "dp_elastic")
    # Each phase resumed at the newest checkpoint of the one before, mid-epoch.
    assert rows["second", 0][0]["batch"] == first and elastic["restored"]["batch"] == second
    assert first % (DP_N // DP_BS) and second % (DP_N // DP_BS)
    # Two processes resumed by two: what both phases computed for the same batches is bitwise equal.
    for r in (0, 1):
        a = {x["batch"]: x for x in rows["first", r]}
        overlap = [x for x in rows["second", r] if x["batch"] in a]
        assert overlap and overlap[0]["batch"] == first
        assert all(x["loss"] == a[x["batch"]]["loss"] and x["samples"] == a[x["batch"]]["samples"] for x in overlap)
    # The trained sequence (phase 1 up to its checkpoint, phase 2 up to its, then one process)
    # is exactly the cursor's global order: each sample once per epoch, nothing skipped or repeated.
    trained: list[list[int]] = []
    for p, lo, hi in (("first", 0, first), ("second", first, second)):
        per = [{x["batch"]: x["samples"] for x in rows[p, r]} for r in (0, 1)]
        trained += [per[0][g] + per[1][g] for g in range(lo, hi)]
        assert all(len(per[r][g]) == DP_BS // 2 for r in (0, 1) for g in range(lo, hi))
    trained += [x["samples"] for x in elastic["rows"]]
    expected = _global_batches()
    assert trained == expected
    per_epoch = len(expected) // EPOCHS
    for e in range(EPOCHS):
        seen = [i for b in trained[e * per_epoch:(e + 1) * per_epoch] for i in b]
        assert sorted(seen) == list(range(DP_N))
    # The state restored into the single plain model is rank 0's at the checkpoint, bit for bit,
    # under the same names (no DataParallel "_layers." prefix).
    _assert_bitwise(_arrays(runs, "dp_second_saved"), _arrays(runs, "dp_elastic_restored"))
    assert elastic["restored"]["names"] == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    # Different world size: the same samples, the same math, not the same rounding.
    two = {x["batch"] for x in rows["second", 0]}
    one = {x["batch"]: x["loss"] for x in elastic["rows"]}
    for g in sorted(two & set(one)):
        halves = [np.uint32(rows["second", r][g - first]["loss"]).view(np.float32) for r in (0, 1)]
        assert abs(float(np.mean(halves)) - one[g]) < 1e-5 * max(1.0, abs(one[g]))

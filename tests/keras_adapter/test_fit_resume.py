"""Acceptance: ``model.fit`` with ``ckptcore_keras.BackupAndRestore``, killed (SIGKILL) and resumed.

One chain of worker processes kills itself at chosen global batches and resumes
in a fresh process; one more process trains every scenario without interruption,
in parallel.  See ``_keras_fit_worker.py`` for the scenarios:

* ``dense_mse``: 15 samples, a Dense model, batch 4, shuffled, 3 epochs,
  ``save_freq=2``; killed after batches 3, 9 (its checkpoint is an epoch's end) and 11.
* ``bn_dropout_decay``: Dropout, BatchNormalization, Adam with ExponentialDecay;
  killed in the middle of epoch 2.
* ``train_step_accumulation`` (gradients summed in a custom ``train_step``) and ``keras_accumulation``
  (``gradient_accumulation_steps=4``): interrupted in the middle of an accumulation
  window (the first by an exception out of ``fit``, the second by SIGKILL of the same
  process), both resumed in a fresh process.
"""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest

pytest.importorskip("tensorflow")

KILLS = {"dense_mse": [3, 9, 11], "bn_dropout_decay": [8], "train_step_accumulation": [8],
         "keras_accumulation": [8]}
SAVE_FREQ = {"dense_mse": 2, "bn_dropout_decay": 3, "train_step_accumulation": 3,
             "keras_accumulation": 3}
BATCHES = {"dense_mse": 4, "bn_dropout_decay": 5, "train_step_accumulation": 5, "keras_accumulation": 5}


# Worker processes in order.  ``n``: SIGKILL after global batch n; ``xn``: an exception
# out of fit after batch n (the process goes on); ``-1``: resume and finish.
CHAIN = [["dense_mse:3"], ["dense_mse:9"], ["dense_mse:11"],
         ["dense_mse:-1", "bn_dropout_decay:8"],
         ["bn_dropout_decay:-1", "train_step_accumulation:x8", "keras_accumulation:8"],
         ["train_step_accumulation:-1", "keras_accumulation:-1"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, spawn_python):
    out = tmp_path_factory.mktemp("fit")
    ref = spawn_python("_keras_fit_worker.py", str(out), *(f"{n}:ref" for n in KILLS))
    try:
        for tasks in CHAIN:
            proc = spawn_python("_keras_fit_worker.py", str(out), *tasks)
            stdout, stderr = proc.communicate(timeout=300)
            killed = not tasks[-1].endswith(":-1")
            expected = -signal.SIGKILL if killed else 0
            assert proc.returncode == expected, f"{tasks}: exit {proc.returncode}\n{stdout}\n{stderr[-6000:]}"
    finally:
        stdout, stderr = ref.communicate(timeout=300)
    assert ref.returncode == 0, f"reference run failed:\n{stdout}\n{stderr[-6000:]}"
    return out


def _log(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _stitch(lines: list[dict]) -> tuple[list[dict], list[int]]:
    """The interrupted runs' batches minus what each resumed process replayed; its restart points."""
    by_pid: dict[int, list[dict]] = {}
    for line in lines:
        by_pid.setdefault(line["pid"], []).append(line)
    runs = list(by_pid.values())  # in order of first appearance, i.e. process order
    stitched, starts = [], []
    for i, run in enumerate(runs):
        if i + 1 < len(runs):
            start = runs[i + 1][0]["g"] - 1  # the checkpoint the next process resumed from
            starts.append(start)
            replayed = [x for x in run if x["g"] > start]
            # the replayed batches are the very same ones, trained again
            assert [x["labels"] for x in replayed] == \
                [x["labels"] for x in runs[i + 1][:len(replayed)]]
            run = [x for x in run if x["g"] <= start]
        stitched += run
    return stitched, starts


def _npz(path) -> list[np.ndarray]:
    with np.load(path) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


def test_dense_mse_label_sequence_equals_uninterrupted_run(runs):
    ref = _log(runs / "dense_mse" / "ref.jsonl")
    stitched, starts = _stitch(_log(runs / "dense_mse" / "ckpt.jsonl"))
    assert starts == [2, 8, 10]  # the last save_freq=2 checkpoint before each kill (3, 9, 11)
    assert [x["g"] for x in ref] == list(range(1, 13))
    assert [x["g"] for x in stitched] == list(range(1, 13))
    assert [x["labels"] for x in stitched] == [x["labels"] for x in ref]
    epochs = [sum((x["labels"] for x in ref[e * 4:(e + 1) * 4]), []) for e in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(15))
    assert len({tuple(o) for o in epochs}) == 3  # reshuffled every epoch
    assert [len(x["labels"]) for x in ref[:4]] == [4, 4, 4, 3]


@pytest.mark.parametrize("name", list(KILLS))
def test_final_state_bitwise_equal(runs, name):
    from _keras_helpers import assert_same_bits

    ref, resumed = _npz(runs / name / "ref.npz"), _npz(runs / name / "ckpt.npz")
    assert len(ref) > 4
    assert_same_bits(ref, resumed, name)
    a = json.loads((runs / name / "ref.json").read_text())
    b = json.loads((runs / name / "ckpt.json").read_text())
    assert a["cursor"] == b["cursor"] and a["cursor"]["epoch"] == 3


@pytest.mark.parametrize("name", ["bn_dropout_decay", "train_step_accumulation", "keras_accumulation"])
def test_resumed_mid_epoch_and_logs_match(runs, name):
    """The last process resumed mid-epoch 2 (index 1) and its epoch logs equal the reference's."""
    lines = _log(runs / name / "ckpt.jsonl")
    (kill,) = KILLS[name]
    start = kill - kill % SAVE_FREQ[name]
    assert lines[-1]["g"] == 3 * BATCHES[name]
    resumed = [x for x in lines if x["pid"] == lines[-1]["pid"]]
    assert resumed[0]["g"] == start + 1 and start % BATCHES[name] != 0 and start // BATCHES[name] == 1
    a = json.loads((runs / name / "ref.json").read_text())
    b = json.loads((runs / name / "ckpt.json").read_text())
    assert b["epochs"] == [1, 2]
    for key, values in b["history"].items():
        if key.startswith("ckpt_"):  # the saves' own figures (timings): logged, not compared
            continue
        assert values == a["history"][key][1:], key  # metrics continue from their saved values


def test_accumulation_checkpoint_was_mid_window(runs):
    """The checkpoint resumed from held a partial window (2 of 4 micro-batches)."""
    import ckptcore

    for name in ("train_step_accumulation", "keras_accumulation"):
        state = ckptcore.load_state(str(runs / name / "ckpt" / "step-000000000006"))
        if name == "keras_accumulation":
            assert (state.accumulation.every, state.accumulation.count) == (4, 2)
        else:
            counter = next(v for k, v in state.model.items() if k.endswith("/n_acum_step"))
            assert int(counter) == 2

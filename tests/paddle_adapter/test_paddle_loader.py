"""ckptcore_paddle.DataLoader: the natural ``for x, y in loader:`` loop resumes exactly; a
ResumableBatchSampler never advanced refuses to save its stale position."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest

paddle = pytest.importorskip("paddle", reason="paddlepaddle is not installed")

import ckptcore  # noqa: E402
import ckptcore_paddle as cp  # noqa: E402
from _loop import EPOCHS, Data  # noqa: E402

N, BS = 100, 8


def _rows(x) -> list[int]:
    data = Data()
    return [int(np.flatnonzero((data.x == row).all(axis=1))[0]) for row in x.numpy()]


def _reference(epochs: int = 1) -> list[list[int]]:
    c = ckptcore.DataCursor(N, BS, seed=5)
    return [b.tolist() for _ in range(epochs) for b in c.iter_epoch()]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_cursor_counts_batches_handed_to_the_loop_not_prefetched(workers):
    cursor = ckptcore.DataCursor(N, BS, seed=5)
    loader = cp.DataLoader(Data(), cursor, num_workers=workers)
    assert isinstance(loader, paddle.io.DataLoader) and len(loader) == 13
    it = iter(loader)
    seen = []
    for i, (x, _) in enumerate(it):
        seen.append(_rows(x))
        # Saved here, the position is exactly the batches the loop received.
        assert (cursor.epoch, cursor.position) == (0, BS * (i + 1))
        if i == 4:
            break
    deadline = time.monotonic() + 10  # the buffer thread / workers fetch ahead in their own time
    while loader.batch_sampler._pass.yielded <= 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loader.batch_sampler._pass.yielded > 5, "the loader did not prefetch: the test shows nothing"
    assert cursor.position == 5 * BS
    saved = cursor.state_dict()
    del it
    # A new iter() (or a new process with the saved cursor) starts at the first batch not received.
    rest = [_rows(x) for x, _ in loader]
    assert seen + rest == _reference() and (cursor.epoch, cursor.position) == (1, 0)
    resumed = cp.DataLoader(Data(), ckptcore.DataCursor.from_state(saved), num_workers=workers)
    assert len(resumed) == 8 and [_rows(x) for x, _ in resumed] == rest


def test_epochs_follow_the_cursor_and_the_loader_is_a_cursor():
    cursor = ckptcore.DataCursor(N, BS, seed=5)
    loader = cp.DataLoader(Data(), cursor)
    got = []
    while cursor.epoch < 2:
        got += [_rows(x) for x, _ in loader]
    assert got == _reference(2)
    assert loader.state_dict() == cursor.state_dict()
    other = cp.DataLoader(Data(), ckptcore.DataCursor(N, BS, seed=5))
    other.load_state_dict({**cursor.state_dict(), "epoch": 0, "position": 96})
    assert [_rows(x) for x, _ in other] == _reference()[12:]


def test_bad_arguments_are_typed_errors():
    cursor = ckptcore.DataCursor(N, BS, seed=5)
    for kw in ({"batch_size": 8}, {"shuffle": True}, {"drop_last": True},
               {"batch_sampler": cp.ResumableBatchSampler(cursor)}):
        with pytest.raises(TypeError, match="the cursor decides"):
            cp.DataLoader(Data(), cursor, **kw)
    with pytest.raises(TypeError, match="DataCursor"):
        cp.DataLoader(Data(), cp.ResumableBatchSampler(cursor))
    with pytest.raises(ValueError, match="100 samples but the cursor walks 50"):
        cp.DataLoader(Data(), ckptcore.DataCursor(50, BS, seed=5))


def _train(net, opt, x, y):
    loss = paddle.nn.functional.cross_entropy(net(x), y).mean()
    loss.backward()
    opt.step()
    opt.clear_grad()


def test_a_sampler_never_advanced_refuses_the_first_save(tmp_path):
    paddle.seed(0)
    net = paddle.nn.Linear(6, 3)
    opt = paddle.optimizer.SGD(0.1, parameters=net.parameters())
    cursor = ckptcore.DataCursor(N, BS, seed=5)
    sampler = cp.ResumableBatchSampler(cursor)
    loader = paddle.io.DataLoader(Data(), batch_sampler=sampler)
    mgr = ckptcore.CheckpointManager(str(tmp_path / "run"))
    for step, (x, y) in enumerate(loader, 1):
        _train(net, opt, x, y)
        if step == 3:
            break
    for cur in (cursor, sampler):
        with pytest.raises(ValueError, match=r"ckptcore_paddle\.DataLoader.*sampler\.advance\(\)") as e:
            mgr.save(step, model=net, optimizer=opt, cursor=cur)
        assert "stale" in str(e.value)
    with pytest.raises(ValueError, match="advance"):
        cp.capture(net, opt, cursor=cursor)
    assert mgr.steps() == []
    # Once advanced, the sampler is trusted again.
    sampler.advance(3)
    mgr.save(3, model=net, optimizer=opt, cursor=cursor)
    assert mgr.restore(3).data["position"] == 3 * BS
    mgr.close()


def test_a_whole_epoch_without_advance_rolls_over_instead_of_raising(caplog):
    cursor = ckptcore.DataCursor(N, BS, seed=5)
    sampler = cp.ResumableBatchSampler(cursor)
    loader = paddle.io.DataLoader(Data(), batch_sampler=sampler)
    with caplog.at_level(logging.WARNING, logger="ckptcore"):
        epochs = [[_rows(x) for x, _ in loader] for _ in range(2)]
    assert epochs == [_reference(2)[:13], _reference(2)[13:]]  # the second epoch is not the first again
    assert "advance() was never called" in caplog.text
    with pytest.raises(ValueError, match="stale"):
        sampler.state_dict()


@pytest.mark.parametrize("workers", [0, 2])
def test_killed_mid_epoch_resumes_bitwise_in_a_new_process(tmp_path, run_python, spawn_python, workers):
    """Saved in the middle of the loop body, mid-epoch, with batches prefetched; SIGKILLed; resumed in
    a new process: the losses from there on and the final state equal an uninterrupted run's."""
    run_python("_loop.py", tmp_path / "ref", tmp_path / "ref-root", workers, "none")
    victim = spawn_python("_loop.py", tmp_path / "run", tmp_path / "root", workers, "kill:20")
    # wait(), not communicate(): orphaned loader workers may hold the pipes open until they notice
    assert victim.wait(timeout=300) == -9
    victim.stdout.close()
    victim.stderr.close()
    run_python("_loop.py", tmp_path / "resumed", tmp_path / "root", workers, "none")
    ref = json.loads((tmp_path / "ref.json").read_text())
    killed = json.loads((tmp_path / "run.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert max(map(int, killed["losses"])) == 20 and resumed["first"] == 20
    assert {**killed["losses"], **resumed["losses"]} == ref["losses"]
    assert len(ref["losses"]) == 13 * EPOCHS
    _assert_same_npz(tmp_path / "ref.npz", tmp_path / "resumed.npz")


def _assert_same_npz(a, b) -> None:
    with np.load(a) as x, np.load(b) as y:
        assert sorted(x.files) == sorted(y.files)
        for k in x.files:
            assert x[k].dtype == y[k].dtype and x[k].tobytes() == y[k].tobytes(), k


def test_s3_root_sigkilled_then_sigtermed_resumes_at_once_and_ends_bitwise(tmp_path, run_python, spawn_python,
                                                                            s3_backend):
    """The preemption story on a bucket (moto server): SIGKILLed (its lease left behind), the next
    process takes the root over at once and is SIGTERMed mid-epoch (it saves the step it finished and
    exits 0), a third finishes: bitwise the uninterrupted run."""
    root, options = s3_backend.url("run"), json.dumps(s3_backend.storage_options)
    run_python("_loop.py", tmp_path / "ref", tmp_path / "ref-root", 2, "none")
    victim = spawn_python("_loop.py", tmp_path / "a", root, 2, "kill:10", options)
    assert victim.wait(timeout=300) == -9
    victim.stdout.close()
    victim.stderr.close()
    started = time.monotonic()
    run_python("_loop.py", tmp_path / "b", root, 2, "term:23", options)  # exits 0 after its save
    assert time.monotonic() - started < 120  # no waiting out the dead writer's lease
    run_python("_loop.py", tmp_path / "c", root, 2, "none", options)
    a, b, c = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "abc")
    assert (max(map(int, a["losses"])), b["first"], max(map(int, b["losses"])), c["first"]) == (10, 8, 23, 23)
    ref = json.loads((tmp_path / "ref.json").read_text())["losses"]
    assert {**a["losses"], **b["losses"], **c["losses"]} == ref
    assert all(b["losses"][k] == ref[k] for k in b["losses"])  # steps 9-10 trained again, identically
    _assert_same_npz(tmp_path / "ref.npz", tmp_path / "c.npz")


def test_the_readme_paddle_block_runs_as_written(tmp_path, run_python):
    """hapi fit for 2 epochs into ckpts/, then the custom loop resumes from its checkpoint and
    trains the third (in a process of its own: the manager's SIGTERM handler stays with it)."""
    readme = Path(__file__).resolve().parents[2] / "README.md"
    work = tmp_path / "work"
    work.mkdir()
    out = run_python(Path(__file__).with_name("_readme.py"), readme, work)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["epoch"] == 3 and result["step"] == 3 * 3  # 70 samples in batches of 32: 3 an epoch
    assert result["steps"] == [3, 6]  # hapi's epoch checkpoints (save_freq=200 never came round)

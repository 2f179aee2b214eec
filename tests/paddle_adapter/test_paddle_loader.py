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


# --- Loader workers end with their training process -------------------------------------------

_SLOW_LOOP = r"""
import os, sys, time
os.environ.setdefault("OMP_NUM_THREADS", "1")
import numpy as np, paddle
import ckptcore, ckptcore_paddle as cp

class Slow(paddle.io.Dataset):
    def __len__(self):
        return 4096
    def __getitem__(self, i):
        return np.full(64, i, np.float32)

loader = cp.DataLoader(Slow(), ckptcore.DataCursor(4096, 8, seed=0), num_workers=2)
for step, x in enumerate(loader):
    if step == 0:
        print("training", flush=True)
    time.sleep(0.2)  # a slow training step: the workers fill their queues and wait
"""


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            pass
    return out


def _alive(pid: int) -> bool:
    """Running or sleeping; a zombie (killed, not yet reaped by its new parent) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")
def test_loader_workers_die_with_a_sigkilled_training_process(tmp_path, spawn_python):
    import os
    import signal
    script = tmp_path / "slow_loop.py"
    script.write_text(_SLOW_LOOP)
    victim = spawn_python(script)
    assert victim.stdout.readline().strip() == "training", victim.stderr.read()
    deadline = time.monotonic() + 30
    while len(workers := _children(victim.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(workers) >= 2, workers
    time.sleep(1)  # let the workers fill the queues and block, as in a long run
    os.kill(victim.pid, signal.SIGKILL)
    assert victim.wait(timeout=30) == -signal.SIGKILL
    killed = time.monotonic()
    while any(map(_alive, workers)) and time.monotonic() < killed + 5:
        time.sleep(0.01)
    left = [w for w in workers if _alive(w)]
    assert not left, f"loader workers {left} outlived their SIGKILLed training process"
    victim.stdout.close()
    victim.stderr.close()


def _record_worker(folder: str, worker_id: int) -> None:
    """A user's worker_init_fn: one file per worker, holding the death signal it found set."""
    import ctypes
    import os
    sig = ctypes.c_int(-1)
    if hasattr(os, "sched_getaffinity"):  # Linux: PR_GET_PDEATHSIG is 2
        ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)
    Path(folder, f"worker-{worker_id}").write_text(f"{os.getppid()} {sig.value}")


def test_a_users_worker_init_fn_still_runs_in_each_worker_after_ours(tmp_path):
    import functools
    import os
    import signal
    cursor = ckptcore.DataCursor(N, BS, seed=5)
    loader = cp.DataLoader(Data(), cursor, num_workers=2,
                           worker_init_fn=functools.partial(_record_worker, str(tmp_path)))
    assert [_rows(x) for x, _ in loader] == _reference()
    found = {p.name: p.read_text().split() for p in tmp_path.iterdir()}
    assert sorted(found) == ["worker-0", "worker-1"], found
    for parent, sig in found.values():
        assert int(parent) == os.getpid()
        if Path("/proc/self/task").is_dir():
            assert int(sig) == signal.SIGKILL  # ours ran first and tied the worker to us
    with pytest.raises(TypeError, match="worker_init_fn"):
        cp.DataLoader(Data(), cursor, num_workers=2, worker_init_fn="not callable")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux")
def test_a_worker_whose_parent_died_before_it_started_exits():
    """The race PR_SET_PDEATHSIG leaves: a parent that died before the worker's prctl is not
    signalled; the worker sees it was reparented and exits (here: a parent pid that is not its
    own stands for that)."""
    import multiprocessing
    import os
    from ckptcore_paddle import _loader
    called = multiprocessing.get_context("fork").Value("i", 0)

    def user(worker_id):
        called.value = 1

    init = _loader._WorkerInit(user)
    init.parent = os.getpid() + 1_000_000  # "the training process", which is not our parent
    proc = multiprocessing.get_context("fork").Process(target=init, args=(0,))
    proc.start()
    proc.join(30)
    assert proc.exitcode == _loader._ORPHANED_EXIT and called.value == 0
    init.parent = os.getpid()
    proc = multiprocessing.get_context("fork").Process(target=init, args=(0,))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0 and called.value == 1

"""ckptcore_torch.DataLoader: the cursor counts batches handed to the loop (not those prefetched),
a SIGKILLed training run resumes at the next unseen sample, workers die with their parent, and
keywords that would let torch choose the samples are refused."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import ckptcore  # noqa: E402
import ckptcore_torch  # noqa: E402

torch.set_num_threads(1)
N, BS = 40, 4


class Ids(torch.utils.data.Dataset):
    """Sample i is i itself: a batch says which samples it holds."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return torch.tensor(i)


def _reference(epochs: int = 1, **kw) -> list[list[int]]:
    c = ckptcore.DataCursor(N, BS, seed=5, **kw)
    return [b.tolist() for _ in range(epochs) for b in c.iter_epoch()]


@pytest.mark.parametrize("workers, persistent", [(0, False), (2, False), (2, True)])
def test_the_cursor_counts_batches_handed_to_the_loop_not_prefetched(workers, persistent):
    cursor = ckptcore.DataCursor(N, BS, seed=5)
    kw = {"num_workers": workers, "prefetch_factor": 2, "persistent_workers": persistent} if workers else {}
    loader = ckptcore_torch.DataLoader(Ids(), cursor, **kw)
    assert isinstance(loader, torch.utils.data.DataLoader) and len(loader) == 10
    it = iter(loader)
    seen = []
    for i, ids in enumerate(it):
        seen.append(ids.tolist())
        assert (cursor.epoch, cursor.position) == (0, BS * (i + 1))  # exactly what the loop received
        if i == 2:
            break
    if workers:  # two workers, two batches each in flight: torch has drawn 3 + 4 - 1 indices
        assert it._pass.yielded > 3, "the loader did not prefetch: the test shows nothing"
    assert cursor.position == 3 * BS
    saved = cursor.state_dict()
    del it
    rest = [ids.tolist() for ids in loader]  # a new iter() starts at the first batch not received
    assert seen + rest == _reference() and (cursor.epoch, cursor.position) == (1, 0)
    resumed = ckptcore_torch.DataLoader(Ids(), ckptcore.DataCursor.from_state(saved), **kw)
    # len(loader) is the whole epoch (what torch's loaders, OneCycleLR(steps_per_epoch=) and
    # Lightning expect); the pass that starts mid-epoch yields its rest.
    rit = iter(resumed)
    assert len(resumed) == 10 and len(rit) == 7 and [ids.tolist() for ids in rit] == rest


@pytest.mark.parametrize("workers", [0, 2])
def test_iter_leaves_the_global_torch_generator_alone_and_seeds_workers_by_position(workers):
    """torch draws each iter()'s worker base seed from the global generator unless the loader
    has one: a resumed run's extra mid-epoch iter() would shift Dropout's stream."""
    kw = {"num_workers": workers} if workers else {}
    cursor = ckptcore.DataCursor(N, BS, seed=5)
    loader = ckptcore_torch.DataLoader(Ids(), cursor, **kw)
    before = torch.get_rng_state()
    it = iter(loader)
    next(it)
    assert torch.equal(torch.get_rng_state(), before)
    seed_a = it._base_seed
    del it
    again = ckptcore_torch.DataLoader(Ids(), ckptcore.DataCursor(N, BS, seed=5), **kw)
    assert iter(again)._base_seed == seed_a  # same cursor position, same worker seeds
    mine = torch.Generator().manual_seed(1)
    own = ckptcore_torch.DataLoader(Ids(), ckptcore.DataCursor(N, BS, seed=5), generator=mine)
    assert own.generator is mine  # a caller's generator is used as given


def test_epochs_follow_the_cursor_and_the_loader_is_a_cursor():
    cursor = ckptcore.DataCursor(N, BS, seed=5, drop_last=True)
    loader = ckptcore_torch.DataLoader(Ids(), cursor, batch_size=BS, drop_last=True, shuffle=False)
    got = []
    while cursor.epoch < 2:
        got += [ids.tolist() for ids in loader]
    assert got == _reference(2, drop_last=True)
    assert loader.state_dict() == cursor.state_dict()
    other = ckptcore_torch.DataLoader(Ids(), ckptcore.DataCursor(N, BS, seed=5, drop_last=True))
    other.load_state_dict({**cursor.state_dict(), "epoch": 0, "position": 32})
    assert [ids.tolist() for ids in other] == _reference()[8:]


def test_a_stale_iterator_refuses_to_move_a_cursor_moved_elsewhere():
    cursor = ckptcore.DataCursor(N, BS, seed=5)
    loader = ckptcore_torch.DataLoader(Ids(), cursor)
    old = iter(loader)
    next(old)
    loader.load_state_dict({**cursor.state_dict(), "position": 20})
    with pytest.raises(RuntimeError, match="start a new iter"):
        next(old)
    assert cursor.position == 20


def test_each_rank_loads_its_part_of_every_global_batch():
    cursors = [ckptcore.DataCursor(N, 6, seed=5) for _ in range(2)]
    loaders = [ckptcore_torch.DataLoader(Ids(), c.shard(r, 2)) for r, c in enumerate(cursors)]
    parts = [[ids.tolist() for ids in loader] for loader in loaders]
    want = [b.tolist() for b in ckptcore.DataCursor(N, 6, seed=5).iter_epoch()]
    assert [a + b for a, b in zip(*parts)] == want
    assert cursors[0].state_dict() == cursors[1].state_dict()


def test_keywords_that_conflict_with_the_cursor_are_refused():
    cursor = ckptcore.DataCursor(N, BS, seed=5)
    base = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(N)), BS, False)
    for kw in ({"shuffle": True}, {"sampler": range(N)}, {"batch_sampler": base}):
        with pytest.raises(TypeError, match="the cursor decides"):
            ckptcore_torch.DataLoader(Ids(), cursor, **kw)
    with pytest.raises(ValueError, match="batch_size=8 but the cursor's .*batch size is 4"):
        ckptcore_torch.DataLoader(Ids(), cursor, batch_size=8)
    with pytest.raises(ValueError, match="drop_last=True but the cursor has drop_last=False"):
        ckptcore_torch.DataLoader(Ids(), cursor, drop_last=True)
    with pytest.raises(ValueError, match="in_order=False"):
        ckptcore_torch.DataLoader(Ids(), cursor, num_workers=2, in_order=False)
    with pytest.raises(TypeError, match="DataCursor"):
        ckptcore_torch.DataLoader(Ids(), cursor.state_dict())
    with pytest.raises(ValueError, match="40 samples but the cursor walks 50"):
        ckptcore_torch.DataLoader(Ids(), ckptcore.DataCursor(50, BS))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(N))

    with pytest.raises(TypeError, match="map-style"):
        ckptcore_torch.DataLoader(Stream(), cursor)


def _steps(log: Path) -> dict[int, list[int]]:
    out = {}
    for line in log.read_text().splitlines():
        step, *ids = map(int, line.split())
        out[step] = ids
    return out


def test_a_run_sigkilled_mid_epoch_with_two_workers_resumes_at_the_next_unseen_sample(
        tmp_path, run_python, spawn_python):
    # The uninterrupted run, here (no workers: the same batches in the same order, one process less)
    from _torch_loader_worker import train
    train(str(tmp_path / "ref"), str(tmp_path / "ref-root"), 0, 0)
    victim = spawn_python("_torch_loader_worker.py", "train", tmp_path / "run", tmp_path / "root", 2, 17)
    assert victim.wait(timeout=120) == -signal.SIGKILL, victim.stderr.read()
    victim.stdout.close()
    victim.stderr.close()
    saved = ckptcore.CheckpointManager(str(tmp_path / "root"), lock=False).latest_step()
    assert saved == 15  # saved every 3 steps; steps 16 and 17 were trained, then lost
    run_python("_torch_loader_worker.py", "train", tmp_path / "resumed", tmp_path / "root", 2, 0)
    ref, killed = _steps(tmp_path / "ref.log"), _steps(tmp_path / "run.log")
    resumed = _steps(tmp_path / "resumed.log")
    assert max(killed) == 17 and min(resumed) == saved + 1
    across = [killed[s] for s in range(1, saved + 1)] + [resumed[s] for s in sorted(resumed)]
    assert across == [ref[s] for s in sorted(ref)]  # the same samples in the same order
    # 48 samples, batches of 4: each epoch of 12 steps sees every sample once (none repeated or skipped)
    assert len(across) == 24 and all(sorted(sum(across[e:e + 12], [])) == list(range(48)) for e in (0, 12))
    with np.load(tmp_path / "ref.npz") as a, np.load(tmp_path / "resumed.npz") as b:
        assert sorted(a.files) == sorted(b.files) == ["bias", "weight"]
        for k in a.files:
            assert a[k].tobytes() == b[k].tobytes(), k


def _gone(pid: int) -> bool:
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True


def test_workers_die_with_a_sigkilled_training_process(spawn_python):
    parent = spawn_python("_torch_loader_worker.py", "hold")
    pids = json.loads(parent.stdout.readline())
    assert len(pids) == 2 and not any(map(_gone, pids))
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(timeout=30)
    t0 = time.monotonic()
    while not all(map(_gone, pids)) and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    took = time.monotonic() - t0
    alive = [p for p in pids if not _gone(p)]
    try:
        assert not alive and took < 2, f"workers {alive} outlived their parent by {took:.1f} s"
    finally:
        for p in alive:
            os.kill(p, signal.SIGKILL)

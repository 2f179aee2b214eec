"""One rank of a gloo job for tests/torch_adapter/test_torch_sharded.py (see _torch_ranks.launch).

``python _torch_sharded_worker.py OUT STEP [STEP ...]``: the steps run in order in one job (a
job costs seconds to start, so one job does several things); each reports into the rank's JSON:

* ``ddp:URL``: a DistributedDataParallel model (Adam, 2 steps) saved with ``group=``; rank 0
  lists which rank wrote how many bytes; every rank loads it back and compares.
* ``save:URL:MESH``: an FSDP2 model (``fully_shard`` per Linear and at the root, on a 1-D mesh,
  or HSDP ``(Replicate, Shard(0))`` on a 2-D one for MESH=2d) trained 2 steps with Adam, captured
  as Shards (``_sharding.dtensor_leaf``) and saved by every rank; rank 0 writes the global
  tensors (``full_tensor()``) to OUT/URL-name.npz.
* ``load:URL:MESH``: a fresh FSDP2 model of this world and mesh, loaded with ``like=`` (this
  rank's blocks only) and restored block by block; rank 0 writes the global tensors to
  OUT/URL-name.loaded-W.npz.
* ``killsave:URL``: every rank saves; the last rank SIGKILLs itself in the gather after writing
  its shards (mid-save); the others report the error they get and how long it took.
* ``refusals``: a Partial DTensor is refused by the capture, another rank's block by the restore.
* ``train:ROOT:STEPS:KILL``: an FSDP2 run with a CheckpointManager(group=) saving every 2 steps,
  resuming from its newest step; rank 1 SIGKILLs itself after step KILL (0: never); rank 0 writes
  the final global tensors to OUT/ROOT-name.final.npz.

Until the capture routes DTensors itself, the state is built here from ``_sharding``'s
functions (the layout: ``model`` by state_dict key, ``optimizer.slots`` by parameter name).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
from _torch_ranks import init, report

rank, world = init()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import ckptcore  # noqa: E402
import ckptcore_torch  # noqa: E402
from ckptcore.errors import GroupError  # noqa: E402
from ckptcore_torch._sharding import is_dtensor, template  # noqa: E402


def to_numpy(t):
    return t.detach().cpu().numpy().copy()


def _net(seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


def _fsdp(seed: int, mesh_kind: str):
    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
            if mesh_kind == "2d" else init_device_mesh("cpu", (world,)))
    net = _net(seed)
    for m in net:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, torch.optim.Adam(net.parameters(), lr=0.05)


def _train(net, opt, steps: range) -> None:
    for step in steps:
        # The global batch of a step is fixed; each rank takes its rows.
        x = torch.from_numpy(np.random.default_rng(step).standard_normal((8, 5)).astype(np.float32))
        net(x[rank::world]).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _slots(net, opt):
    names = {id(p): n for n, p in net.named_parameters()}
    return {names[id(p)]: s for p, s in opt.state.items()}


def full(net, opt) -> dict[str, np.ndarray]:
    """Every parameter and optimizer state as a global array (collective: every rank calls)."""
    out = {}
    for k, t in net.state_dict().items():
        out[f"model/{k}"] = to_numpy(t.full_tensor() if is_dtensor(t) else t)
    for n, s in _slots(net, opt).items():
        for k, t in s.items():
            out[f"optimizer/{n}/{k}"] = to_numpy(t.full_tensor() if is_dtensor(t) else t)
    return out


def _npz(path: str, arrays: dict) -> None:
    if rank == 0:
        np.savez(path, **arrays)


# -- the steps ----------------------------------------------------------------------------------
def do_ddp(out: dict, url: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8)))
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    for step in range(2):
        ddp(torch.randn(4, 64) + rank).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert all(k.startswith("module.") for k in ddp.state_dict())
    group = ckptcore_torch.process_group()
    ckptcore.save_state(url, model=ddp, optimizer=opt, group=group)
    state = ckptcore_torch.capture(ddp, opt)
    if rank == 0:
        by_rank: dict[str, int] = {}
        for f in Path(url).iterdir():
            part = [p for p in f.name.split("-") if p.startswith("r") and p[1:].isdigit()]
            if f.name.startswith("shard") and part:
                by_rank[part[0]] = by_rank.get(part[0], 0) + f.stat().st_size
        out["ddp_bytes"] = by_rank
    torch.manual_seed(1)  # a fresh DDP model and optimizer, restored from the checkpoint
    again = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8)))
    opt2 = torch.optim.Adam(again.parameters(), lr=0.01)
    got = ckptcore.load_state(url, group=group, model=again, optimizer=opt2)
    now = ckptcore_torch.capture(again, opt2)
    out["ddp_same"] = all(now.model[k].tobytes() == v.tobytes() for k, v in state.model.items()) and \
        all(now.optimizer.slots[n][k].tobytes() == v.tobytes()
            for n, s in state.optimizer.slots.items() for k, v in s.items())
    out["ddp_keys"] = sorted(got.model)


def do_save(out: dict, url: str, mesh: str) -> None:
    net, opt = _fsdp(0, mesh)
    _train(net, opt, range(2))
    out["save_leaves"] = {k: repr(v) for k, v in ckptcore_torch.capture(net, opt, rng=False).model.items()}
    ckptcore.save_state(url, model=net, optimizer=opt, rng=False, group=ckptcore_torch.process_group())
    _npz(f"{url}.npz", full(net, opt))


def do_load(out: dict, url: str, mesh: str) -> None:
    net, opt = _fsdp(123, mesh)  # other weights: the load must replace every value
    got = ckptcore.load_state(url, like=template(net), group=ckptcore_torch.process_group(),
                              model=net, optimizer=opt)
    out[f"load_leaves_{world}"] = {k: repr(v) for k, v in got.model.items()}
    out["slot_types"] = sorted({type(v).__name__ for s in opt.state.values() for v in s.values()})
    _npz(f"{url}.loaded-{world}.npz", full(net, opt))


class _DieInGather:
    """The group of the last rank in ``killsave``: it SIGKILLs itself when it would send its
    reply (its shard files are written by then: the middle of the save)."""

    def __init__(self, inner):
        self.inner, self.rank, self.size = inner, inner.rank, inner.size

    def gather(self, data, *, timeout):
        os.kill(os.getpid(), signal.SIGKILL)

    def broadcast(self, data, *, timeout):
        return self.inner.broadcast(data, timeout=timeout)

    def barrier(self, *, timeout):
        return self.inner.barrier(timeout=timeout)


def do_killsave(out: dict, url: str) -> None:
    net, opt = _fsdp(0, "1d")
    _train(net, opt, range(1))
    group = ckptcore_torch.process_group()
    if rank == world - 1:
        group = _DieInGather(group)
    t0 = time.monotonic()
    try:
        ckptcore.save_state(url, model=net, optimizer=opt, rng=False, group=group)
        out["killsave"] = "committed"
    except GroupError as e:
        out["killsave"] = f"{type(e).__name__}: {e}"
    out["killsave_took"] = time.monotonic() - t0


def do_train(out: dict, root: str, steps: int, kill: int) -> None:
    net, opt = _fsdp(0, "1d")
    mgr = ckptcore.CheckpointManager(root, group=ckptcore_torch.process_group())
    start = mgr.latest_step() or 0
    if start:
        mgr.restore(like=template(net), model=net, optimizer=opt)
    out["start"] = start
    for step in range(start + 1, steps + 1):
        _train(net, opt, range(step, step + 1))
        if step % 2 == 0:
            mgr.save(step, model=net, optimizer=opt, rng=False)
        if step == kill and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()
    _npz(f"{root}.final.npz", full(net, opt))


def do_refusals(out: dict) -> None:
    """A Partial DTensor cannot be captured; a block loaded for another rank is not assigned."""
    from torch.distributed.tensor import Partial, Shard, distribute_tensor

    from ckptcore.errors import CaptureError, RestoreError

    mesh = init_device_mesh("cpu", (world,))
    net = torch.nn.Linear(3, 4)
    net.weight = torch.nn.Parameter(distribute_tensor(net.weight.detach(), mesh, [Partial()]))
    try:
        ckptcore_torch.capture(net, rng=False)
        out["partial"] = None
    except CaptureError as e:
        out["partial"] = str(e)
    net.weight = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]))
    state = ckptcore_torch.capture(net, rng=False)
    wrong = state.model["weight"]  # this rank's block, offered at another rank's offsets
    state.model["weight"] = ckptcore.Shard(wrong.data, wrong.global_shape, (2 - wrong.offsets[0], 0))
    try:
        ckptcore_torch.restore(state, net, rng=False)
        out["wrong_block"] = None
    except RestoreError as e:
        out["wrong_block"] = str(e)


def main(out_dir: str, steps: list[str]) -> None:
    out: dict = {"rank": rank, "world": world}
    try:
        for spec in steps:
            Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))  # kept if killed next
            kind, *args = spec.split(":")
            if kind == "ddp":
                do_ddp(out, args[0])
            elif kind == "save":
                do_save(out, *args)
            elif kind == "load":
                do_load(out, *args)
            elif kind == "killsave":
                do_killsave(out, args[0])
            elif kind == "refusals":
                do_refusals(out)
            elif kind == "train":
                do_train(out, args[0], int(args[1]), int(args[2]))
            dist.barrier() if kind != "killsave" else None
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        report(out)
    if not any(s.startswith("killsave") for s in steps):
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

"""One rank of a gloo job on 127.0.0.1 saving or loading sharded states through ckptcore:
``python _sharded_worker.py RANK PORTS OUT MODE URL [ARG]`` (S3 options, if any, in
``CKPT_TEST_S3_OPTIONS`` as JSON).

MODE ``save``: the rank saves its blocks (an uneven split along dimension 0 among the job's
ranks) of the global arrays of ``_sharded_globals.py`` plus a replicated array and its own RNG
row, through ``ckptcore_paddle.process_group()``.
MODE ``load``: the rank loads its blocks of a checkpoint saved by ARG ranks, with a template
and ``group=``, and compares them with the global arrays, bit for bit.
MODE ``zero``: a ZeRO stage-1 training run (``fleet`` with ``sharding_degree`` = the job's
ranks: each rank holds the AdamW states of its own parameters) with a CheckpointManager at URL,
resuming from its newest step; ARG ``steps[:kill]``: train to ``steps``, and the last rank
SIGKILLs itself right after finishing step ``kill``.  At the end each rank dumps its weights and
its own optimizer slots, by structured name, to OUT/final<rank>.npz.
MODE ``dist``: a model whose first layer is cut among the ranks with ``shard_tensor``
(weight by columns, bias by rows) and whose second is replicated: without a checkpoint at URL,
rank 0 dumps the dense values to OUT/global.npz and every rank saves its blocks with the group;
with one, the ranks build the model with other values, restore it with ``load_state(...,
model=, group=)`` and compare their local blocks with the dense values, bit for bit.
MODE ``pdcp``: the same model, one AdamW step, saved with Paddle's own
``paddle.distributed.save_state_dict({"model": ..., "opt": ...}, URL)``; rank 0 dumps the dense
values after the step to OUT/global.npz.
MODE ``plain``: a single process (no fleet, plain AdamW) restores URL's newest step and dumps
every slot to OUT/final0.npz: a checkpoint of a sharded optimizer restored unsharded.
Each rank writes what it saw to OUT/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from _sharded_globals import check_rank_state, load_template, rank_state as _state  # noqa: E402,I001


def _env(rank: int, ports: list[str]) -> None:
    eps = [f"127.0.0.1:{p}" for p in ports]
    os.environ.update({"PADDLE_TRAINER_ID": str(rank), "PADDLE_TRAINERS_NUM": str(len(eps)),
                       "PADDLE_TRAINER_ENDPOINTS": ",".join(eps),
                       "PADDLE_CURRENT_ENDPOINT": eps[rank], "PADDLE_DISTRI_BACKEND": "gloo"})


def main() -> None:
    rank, ports, out, mode, url = (int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3],
                                   sys.argv[4], sys.argv[5])
    arg = sys.argv[6] if len(sys.argv) > 6 else ""
    _env(rank, ports)
    opts = json.loads(os.environ.get("CKPT_TEST_S3_OPTIONS") or "{}")
    report: dict = {"rank": rank, "world": len(ports)}
    if mode in ("save", "load"):
        import paddle.distributed as dist

        import ckptcore_paddle

        if len(ports) > 1:
            dist.init_parallel_env()
        group = ckptcore_paddle.process_group()
        if mode == "save":
            _save(group, url, opts, report)
        else:
            _load(group, url, opts, int(arg), report)
    elif mode == "zero":
        _zero(rank, len(ports), url, out, arg, report)
    elif mode == "plain":
        _plain(url, out, report)
    elif mode in ("dist", "pdcp"):
        _dist_tensors(rank, url, out, mode, opts, report)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    sys.exit(0)


def _save(group, url: str, opts: dict, report: dict) -> None:
    import ckptcore

    info = ckptcore.save_state(url, _state(group.rank, group.size, template=False), group=group,
                               storage_options=opts)
    report["writer"] = info.writer["id"]


def _load(group, url: str, opts: dict, saved_world: int, report: dict) -> None:
    import ckptcore

    like = load_template(group.rank, group.size, saved_world)
    got = ckptcore.load_state(url, like=like, group=group, storage_options=opts)
    report["same"] = check_rank_state(got, group.rank, group.size, saved_world)


def _net():
    import paddle

    paddle.seed(5)
    return paddle.nn.Sequential(paddle.nn.Linear(6, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, 8),
                                paddle.nn.ReLU(), paddle.nn.Linear(8, 3))


def _optimizer(params):
    import paddle

    sched = paddle.optimizer.lr.StepDecay(0.05, step_size=3, gamma=0.5)
    return paddle.optimizer.AdamW(learning_rate=sched, parameters=params, weight_decay=0.01), sched


def _batch(step: int, rank: int, world: int):
    import numpy as np
    import paddle

    # the global batch of a step is fixed; each rank takes its rows (the data cursor's job in a
    # real run; here the step number is the position)
    x = np.random.default_rng(1000 + step).standard_normal((4 * world, 6)).astype("float32")
    return paddle.to_tensor(x[4 * rank:4 * (rank + 1)])


def _zero(rank: int, world: int, url: str, out: str, arg: str, report: dict) -> None:
    import numpy as np
    import paddle
    from paddle.distributed import fleet

    import ckptcore
    import ckptcore_paddle

    steps, _, kill = arg.partition(":")
    steps, kill = int(steps), int(kill) if kill else None
    paddle.set_device("cpu")
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1,
                               "sharding_degree": world}
    fleet.init(is_collective=True, strategy=strategy)
    net = _net()
    opt, sched = _optimizer(net.parameters())
    model = fleet.distributed_model(net)
    opt = fleet.distributed_optimizer(opt)
    group = ckptcore_paddle.process_group()
    mgr = ckptcore.CheckpointManager(url, keep=2, group=group)
    start = 0
    if mgr.latest_step() is not None:
        state = mgr.restore(model=model, optimizer=opt)
        start = state.step
    report["start"] = start
    for step in range(start + 1, steps + 1):
        loss = model(_batch(step, rank, world)).square().mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        sched.step()
        if kill is not None and step == kill and rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if step % 2 == 0:
            mgr.save(step, model=model, optimizer=opt)
    mgr.close()
    _dump(net, opt, os.path.join(out, f"final{rank}.npz"))
    report["lr"] = float(opt.get_lr())


def _dump(net, opt, path: str) -> None:
    import numpy as np

    import ckptcore
    import ckptcore_paddle

    state = ckptcore_paddle.capture(net, opt, rng=False)
    arrays = {f"model/{k}": v for k, v in state.model.items()}
    for s, per in state.optimizer.slots.items():
        for slot, v in per.items():
            data = v.data if isinstance(v, ckptcore.Shard) else v
            if data.size:  # (another rank's slot: an empty block here)
                arrays[f"slot/{s}/{slot}"] = data
    np.savez(path, **arrays)


def _plain(url: str, out: str, report: dict) -> None:
    import ckptcore

    net = _net()
    opt, sched = _optimizer(net.parameters())
    with ckptcore.CheckpointManager(url) as mgr:
        state = mgr.restore(model=net, optimizer=opt)
    report["start"] = state.step
    report["lr"] = float(opt.get_lr())
    _dump(net, opt, os.path.join(out, "final0.npz"))


def _dist_net(world: int, dense: bool = False):
    import paddle
    import paddle.distributed as dist

    net = _net()
    if dense:
        return net, None
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["x"])

    def shard_fn(name, layer, pm):
        if name == "0":
            layer.weight = dist.shard_tensor(layer.weight, pm, [dist.Shard(1)])
            layer.bias = dist.shard_tensor(layer.bias, pm, [dist.Shard(0)])
        elif name == "2":
            layer.weight = dist.shard_tensor(layer.weight, pm, [dist.Replicate()])

    return dist.shard_layer(net, mesh, shard_fn), mesh


def _dist_tensors(rank: int, url: str, out: str, mode: str, opts: dict, report: dict) -> None:
    import numpy as np
    import paddle
    import paddle.distributed as dist

    import ckptcore
    import ckptcore_paddle

    paddle.set_device("cpu")
    dist.init_parallel_env()
    world = dist.get_world_size()
    group = ckptcore_paddle.process_group()
    net, _ = _dist_net(world)

    def dense(t):
        return dist.reshard(t, t.process_mesh, [dist.Replicate()] * len(t.placements))._local_value() \
            if t.is_dist() else t

    if mode == "pdcp":
        opt = paddle.optimizer.AdamW(0.01, parameters=net.parameters())
        net(_batch(1, 0, 1)).square().mean().backward()
        opt.step()
        dist.save_state_dict({"model": net.state_dict(), "opt": opt.state_dict()}, url)
        values = {k: dense(v).numpy() for k, v in net.state_dict().items()}  # (collective)
        if rank == 0:
            np.savez(os.path.join(out, "global.npz"), **values)
        return
    exists = ckptcore.inspect(url, storage_options=opts) if _exists(url, opts) else None
    if exists is None:
        values = {k: dense(v).numpy() for k, v in net.state_dict().items()}
        if rank == 0:
            np.savez(os.path.join(out, "global.npz"), **values)
        state = ckptcore_paddle.capture(net, rng=False)
        report["leaves"] = {k: type(v).__name__ for k, v in state.model.items()}
        ckptcore.save_state(url, state, group=group, storage_options=opts)
        return
    for p in net.parameters():  # other values, so that the restore has to change them
        local = p._local_value() if p.is_dist() else p
        local.set_value(np.full(local.shape, 7.0, "float32"))
    ckptcore.load_state(url, model=net, group=group, storage_options=opts)
    with np.load(os.path.join(out, "global.npz")) as g:
        want = {k: g[k] for k in g.files}
    same = {}
    for k, t in net.state_dict().items():
        local = (t._local_value() if t.is_dist() else t).numpy()
        if t.is_dist() and not all(p.is_replicated() for p in t.placements):
            from ckptcore_paddle._sharding import _local_box
            shape, offset, _ = _local_box(t, k)
            block = want[k][tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        else:
            block = want[k]
        same[k] = block.tobytes() == local.tobytes()
    report["same"] = same


def _exists(url: str, opts: dict) -> bool:
    import ckptcore

    try:
        ckptcore.inspect(url, storage_options=opts)
        return True
    except ckptcore.CheckpointNotFoundError:
        return False


if __name__ == "__main__":
    main()

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
MODE ``plain``: a single process (no fleet, plain AdamW) restores URL's newest step and dumps
every slot to OUT/final0.npz: a checkpoint of a sharded optimizer restored unsharded.
Each rank writes what it saw to OUT/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from _sharded_globals import WORLD_RNG, global_arrays, split


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
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    sys.exit(0)


def _state(rank: int, world: int, *, template: bool):
    import numpy as np

    import ckptcore

    def block(name, g):
        a, b = split(g.shape[0], world)[rank:rank + 2]
        data = np.zeros_like(g[a:b]) if template else np.ascontiguousarray(g[a:b])
        return ckptcore.Shard(data, g.shape, (a,) + (0,) * (g.ndim - 1))

    g = global_arrays()
    rng = np.random.default_rng(WORLD_RNG + rank).integers(0, 2**32, (1, 4), dtype=np.uint32)
    return ckptcore.TrainingState(
        model={"emb": block("emb", g["emb"]), "head": g["head"]},  # head: replicated
        optimizer=ckptcore.OptimizerState("adamw", step=9, slots={
            "emb": {"moment1": block("m1", g["m1"]), "moment2": block("m2", g["m2"])}}),
        rng={"numpy_rank": ckptcore.Shard(np.zeros_like(rng) if template else rng,
                                          (world, 4), (rank, 0))},
        data={"epoch": 1, "position": 40}, step=9)


def _save(group, url: str, opts: dict, report: dict) -> None:
    import ckptcore

    info = ckptcore.save_state(url, _state(group.rank, group.size, template=False), group=group,
                               storage_options=opts)
    report["writer"] = info.writer["id"]


def _load(group, url: str, opts: dict, saved_world: int, report: dict) -> None:
    import numpy as np

    import ckptcore

    like = _state(group.rank, group.size, template=True)
    # the RNG rows were saved per rank of the saving job: ask for this rank's row if it had one
    like.rng = {"numpy_rank": ckptcore.Shard(np.zeros((1, 4), np.uint32), (saved_world, 4),
                                             (min(group.rank, saved_world - 1), 0))}
    got = ckptcore.load_state(url, like=like, group=group, storage_options=opts)
    want = _state(group.rank, group.size, template=False)
    report["same"] = {
        "emb": got.model["emb"].data.tobytes() == want.model["emb"].data.tobytes(),
        "emb_offsets": got.model["emb"].offsets == want.model["emb"].offsets,
        "head": got.model["head"].tobytes() == want.model["head"].tobytes(),
        "m1": got.optimizer.slots["emb"]["moment1"].data.tobytes()
        == want.optimizer.slots["emb"]["moment1"].data.tobytes(),
        "m2": got.optimizer.slots["emb"]["moment2"].data.tobytes()
        == want.optimizer.slots["emb"]["moment2"].data.tobytes(),
        "rest": (got.step, got.data) == (9, {"epoch": 1, "position": 40}),
        "rng": got.rng["numpy_rank"].data.tobytes() == np.random.default_rng(
            WORLD_RNG + min(group.rank, saved_world - 1)).integers(
                0, 2**32, (1, 4), dtype=np.uint32).tobytes(),
    }


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


if __name__ == "__main__":
    main()

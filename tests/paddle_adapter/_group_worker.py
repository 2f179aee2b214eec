"""One rank of a gloo job on 127.0.0.1 exercising ckptcore_paddle.process_group():
``python _group_worker.py RANK PORTS OUT MODE``.

MODE ``protocol``: process_group() before init_parallel_env (refused), then the shared protocol
checks on the whole job and, with 4 ranks, on the sub-group of ranks 2 and 3.
MODE ``kill``/``hang``: after a good round the last rank SIGKILLs/SIGSTOPs itself while the
others are inside a gather with a 3 s deadline; then one more call on the broken group.
MODE ``save``: every rank saves the same DataParallel model and Adam through the group.
MODE ``savekill``: a first group save commits; the last rank is SIGKILLed; the others' second
save must fail within the group timeout and leave the first one the newest.
Each rank writes what it saw to OUT/rank<r>.json and exits through sys.exit.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

DEADLINE = 3.0


def main() -> None:
    rank, ports, out, mode = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3], sys.argv[4]
    eps = [f"127.0.0.1:{p}" for p in ports]
    os.environ.update({"PADDLE_TRAINER_ID": str(rank), "PADDLE_TRAINERS_NUM": str(len(eps)),
                       "PADDLE_TRAINER_ENDPOINTS": ",".join(eps),
                       "PADDLE_CURRENT_ENDPOINT": eps[rank], "PADDLE_DISTRI_BACKEND": "gloo"})
    import paddle.distributed as dist

    import ckptcore
    import ckptcore_paddle

    report: dict = {"rank": rank}
    if mode == "protocol":
        try:
            ckptcore_paddle.process_group()
            report["before_init"] = None
        except ckptcore.CheckpointError as e:
            report["before_init"] = str(e)
    dist.init_parallel_env()
    group = ckptcore_paddle.process_group()
    report["size"] = group.size
    if mode == "protocol":
        _protocol(group, rank, report)
    elif mode in ("kill", "hang"):
        _dead_peer(group, rank, mode, report)
    else:
        _save(group, out, rank, mode, report)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    sys.stdout.flush()
    sys.exit(0)


def _protocol(group, rank: int, report: dict) -> None:
    import paddle.distributed as dist

    import ckptcore
    import ckptcore_paddle
    from _group_checks import check_protocol

    report["checks"] = check_protocol(group)
    if group.size == 4:
        sub = dist.new_group([2, 3])  # every rank of the job takes part in creating it
        if rank in (2, 3):
            g = ckptcore_paddle.process_group(sub)
            report["sub"] = {"rank": g.rank, "size": g.size, "checks": check_protocol(g, rounds=5)}
        else:
            try:
                ckptcore_paddle.process_group(sub)
                report["sub"] = None
            except ckptcore.CheckpointError as e:
                report["sub"] = {"refused": str(e)}
        group.barrier(timeout=30)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _dead_peer(group, rank: int, mode: str, report: dict) -> None:
    import ckptcore

    records = _Records()
    logging.getLogger("ckptcore").addHandler(records)
    group.gather(b"ok", timeout=30)
    group.barrier(timeout=30)
    if rank == group.size - 1:
        # The others are inside the gather by then (it cannot finish without this rank).
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
        time.sleep(60)  # not reached after a SIGKILL; a stopped rank is killed by the test
    t = time.monotonic()
    try:
        group.gather(b"second" * 1000, timeout=DEADLINE)
        report["error"] = None
    except ckptcore.GroupError as e:
        report["error"], report["message"] = type(e).__name__, str(e)
    report["seconds"] = time.monotonic() - t
    t = time.monotonic()
    try:
        group.broadcast(b"x" if rank == 0 else None, timeout=DEADLINE)
        report["after"] = None
    except ckptcore.GroupError as e:
        report["after"], report["after_message"] = type(e).__name__, str(e)
    report["after_seconds"] = time.monotonic() - t
    report["logged"] = records.messages


def _save(group, out: str, rank: int, mode: str, report: dict) -> None:
    import numpy as np
    import paddle

    import ckptcore
    from ckptcore import _knobs

    paddle.seed(3)
    net = paddle.nn.Sequential(paddle.nn.Linear(16, 256), paddle.nn.ReLU(), paddle.nn.Linear(256, 128),
                               paddle.nn.ReLU(), paddle.nn.Linear(128, 10))
    model = paddle.DataParallel(net)
    opt = paddle.optimizer.Adam(0.01, parameters=model.parameters())
    rs = np.random.RandomState(rank)
    for _ in range(2):
        loss = model(paddle.to_tensor(rs.randn(8, 16).astype("float32"))).square().mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
    root = os.path.join(out, "ck")
    info = ckptcore.save_state(root, model=model, optimizer=opt, group=group, overwrite=True)
    report["writer"] = info.writer["id"]
    np.savez(os.path.join(out, f"weights{rank}.npz"),
             *[p.numpy() for p in net.parameters()])
    if mode == "save":
        return
    group.barrier(timeout=30)
    if rank == group.size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = time.monotonic()
    with _knobs.override(group_timeout=5.0):
        try:
            ckptcore.save_state(root, model=model, optimizer=opt, group=group, overwrite=True)
            report["second"] = "committed"
        except ckptcore.GroupError as e:
            report["second"] = type(e).__name__
    report["seconds"] = time.monotonic() - t
    report["newest_writer"] = ckptcore.inspect(root).writer["id"]


if __name__ == "__main__":
    main()

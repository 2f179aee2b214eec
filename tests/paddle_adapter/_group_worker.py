"""One rank of a gloo job on 127.0.0.1 exercising ckptcore_paddle.process_group():
``python _group_worker.py RANK PORTS OUT MODE``.

MODE ``protocol``: gather/broadcast/barrier with payloads of every kind, then many small rounds.
MODE ``kill``: after one good round the last rank SIGKILLs itself while the others wait.
MODE ``save``: every rank saves the same DataParallel model and Adam through the group.
MODE ``savekill``: a first group save commits; the last rank is SIGKILLed; the others' second
save must fail within the group timeout and leave the first one the newest.
Each rank writes what it saw to OUT/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def _payload(rank: int, i: int) -> bytes:
    return [b"", bytes([rank]) * (rank * 1000 + 1), b"\x00" * 7,
            bytes(range(256)) * (4096 * (rank + 1)) + b"tail%d" % rank][i]


def main() -> None:
    rank, ports, out, mode = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3], sys.argv[4]
    eps = [f"127.0.0.1:{p}" for p in ports]
    os.environ.update({"PADDLE_TRAINER_ID": str(rank), "PADDLE_TRAINERS_NUM": str(len(eps)),
                       "PADDLE_TRAINER_ENDPOINTS": ",".join(eps),
                       "PADDLE_CURRENT_ENDPOINT": eps[rank], "PADDLE_DISTRI_BACKEND": "gloo"})
    import paddle.distributed as dist

    import ckptcore
    import ckptcore_paddle

    dist.init_parallel_env()
    group = ckptcore_paddle.process_group()
    last = group.size - 1
    report = {"rank": group.rank, "size": group.size,
              "is_protocol": isinstance(group, ckptcore.ProcessGroup)}
    if mode == "protocol":
        report["gather_exact"] = report["broadcast_exact"] = True
        for i in range(4):
            got = group.gather(_payload(rank, i), timeout=30)
            if got is not None:
                report["gather_exact"] &= got == [_payload(r, i) for r in range(group.size)]
            b = group.broadcast(b"zero %d" % i * (i + 1) if rank == 0 else None, timeout=30)
            report["broadcast_exact"] &= b == b"zero %d" % i * (i + 1)
            group.barrier(timeout=30)
        report["rounds_exact"] = True
        for i in range(20):
            got = group.gather(b"%d:%d" % (rank, i), timeout=30)
            if got is not None:
                report["rounds_exact"] &= got == [b"%d:%d" % (r, i) for r in range(group.size)]
    elif mode == "kill":
        group.gather(b"ok", timeout=30)
        group.barrier(timeout=30)
        if rank == last:
            os.kill(os.getpid(), signal.SIGKILL)
        t = time.monotonic()
        try:
            group.gather(b"second", timeout=5)
            group.broadcast(b"x" if rank == 0 else None, timeout=5)
            report["error"] = None
        except ckptcore.GroupError as e:
            report["error"], report["message"] = type(e).__name__, str(e)
        report["seconds"] = time.monotonic() - t
    else:
        _save(group, out, rank, mode, report)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    sys.stdout.flush()
    os._exit(0)  # the store's server thread on rank 0 would wait for the killed rank


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

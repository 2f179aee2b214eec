"""A Paddle training loop with a local root and a bucket backup, for test_backup_kill.py:
``python _backup_worker.py LOCAL BACKUP OUT`` (storage options as JSON in CKPT_TEST_S3_OPTIONS).

It resumes from the best tier (``restore(seed=True)``: from the bucket when the local root is
gone), trains to STEPS, saving every 2 steps, then writes its parameters and optimizer state to
OUT and prints DONE.  Each step's batch depends on the step only (the data position is the
step), so a resumed run sees what an uninterrupted one does.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import paddle  # noqa: E402

import ckptcore  # noqa: E402
import ckptcore_paddle  # noqa: E402
from _backup_kill import print_events  # noqa: E402

STEPS = 24


def main(local: str, backup: str, out: str) -> None:
    print_events()
    opts = json.loads(os.environ.get("CKPT_TEST_S3_OPTIONS") or "{}")
    paddle.seed(3)
    net = paddle.nn.Sequential(paddle.nn.Linear(16, 256), paddle.nn.ReLU(), paddle.nn.Linear(256, 64),
                               paddle.nn.ReLU(), paddle.nn.Linear(64, 4))
    sched = paddle.optimizer.lr.StepDecay(0.01, step_size=5, gamma=0.7)
    opt = paddle.optimizer.Adam(sched, parameters=net.parameters())
    mgr = ckptcore.CheckpointManager(local, keep=2, backup=ckptcore.Backup(backup, storage_options=opts))
    step = 0
    try:
        step = mgr.restore(model=net, optimizer=opt, seed=True).step
    except ckptcore.CheckpointNotFoundError:
        pass
    print("READY", step, flush=True)
    while step < STEPS:
        step += 1
        x = paddle.to_tensor(np.random.default_rng(step).standard_normal((32, 16)).astype("float32"))
        loss = net(x).square().mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        sched.step()
        if step % 2 == 0:
            mgr.save(step, model=net, optimizer=opt)
        time.sleep(0.03)
    mgr.close()
    state = ckptcore_paddle.capture(net, opt, rng=False)
    arrays = {f"model/{k}": v for k, v in state.model.items()}
    arrays.update({f"opt/{p}/{s}": v for p, per in state.optimizer.slots.items() for s, v in per.items()})
    np.savez(out, lr=np.float64(opt.get_lr()), **arrays)
    print("DONE", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])

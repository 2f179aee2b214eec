"""One PyTorch training process for test_torch_resume.py: a plain loop over a DataCursor, an MLP
with Dropout, Adam and a StepLR, a CheckpointManager saving every SAVE_EVERY steps.

    python _torch_resume_worker.py ROOT OUT [KILL_AT] [--async] [--wait]

Resumes from ROOT's newest checkpoint if there is one (printing ``RESUMED <step>``); with KILL_AT
it prints ``KILL <step>`` after that step and waits to be SIGKILLed, mid-epoch; at the end it
writes the final weights, optimizer state and lr to OUT (an .npz).  With ``--wait`` it first
builds a throwaway optimizer (the first one imports ``torch._dynamo``: seconds), then waits for a
line on stdin: a resuming process started while the killed one still trains.
"""

from __future__ import annotations

import signal
import sys

import numpy as np
import torch

import ckptcore
from ckptcore.cursor import DataCursor

torch.set_num_threads(1)
N, FEATURES, CLASSES, BATCH, EPOCHS, SAVE_EVERY = 240, 6, 3, 16, 3, 4


def main(root: str, out: str, kill_at: int, async_save: bool) -> None:
    g = np.random.default_rng(5)
    x = torch.from_numpy(g.standard_normal((N, FEATURES)).astype(np.float32))
    y = torch.from_numpy(g.integers(0, CLASSES, N).astype(np.int64))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                              torch.nn.Linear(16, CLASSES))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.7)
    cursor = DataCursor(N, BATCH, seed=3)
    objects = {"model": net, "optimizer": opt, "scheduler": sched, "cursor": cursor}
    mgr = ckptcore.CheckpointManager(root, keep=2, async_save=async_save, save_on_preemption=False)
    step = 0
    if mgr.latest_step() is not None:
        step = mgr.restore(**objects).step
        print(f"RESUMED {step}", flush=True)
    net.train()
    while cursor.epoch < EPOCHS:
        idx = torch.from_numpy(np.asarray(cursor.next_batch(), dtype=np.int64))
        torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        step += 1
        if step % SAVE_EVERY == 0:
            mgr.save(step, **objects)
        if step == kill_at:
            print(f"KILL {step}", flush=True)
            signal.pause()
    mgr.close()
    arrays = {f"model/{k}": v.numpy() for k, v in net.state_dict().items()}
    arrays.update({f"opt/{i}/{k}": v.numpy() for i, st in opt.state_dict()["state"].items()
                   for k, v in st.items()})
    arrays["lr"] = np.asarray(sched.get_last_lr())
    np.savez(out, step=step, **arrays)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--wait" in sys.argv:
        torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
        print("READY", flush=True)
        sys.stdin.readline()
    main(args[0], args[1], int(args[2]) if len(args) > 2 else -1, "--async" in sys.argv)

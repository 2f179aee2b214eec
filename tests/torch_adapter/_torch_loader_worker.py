"""A real training process for tests/torch_adapter/test_torch_loader.py (run as a subprocess).

``train OUT ROOT WORKERS KILL_AT``: trains a tiny linear model with SGD over
``ckptcore_torch.DataLoader(num_workers=WORKERS, prefetch_factor=2)`` for EPOCHS epochs,
resuming from the newest checkpoint in ROOT if there is one, saving every SAVE_EVERY steps
(model weights as a plain TrainingState, the cursor with ``cursor=``).  Each step appends
``step sample-ids`` to OUT.log (flushed, so a SIGKILL loses nothing written); at step KILL_AT
(0: never) the process SIGKILLs itself, mid-epoch, with batches prefetched by the workers.  At
the end the final weights go to OUT.npz.

``hold``: iterates one batch with two workers, prints the workers' pids as JSON and sleeps, for
the test to SIGKILL it and watch the workers go.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np
import torch

import ckptcore
import ckptcore_torch

torch.set_num_threads(1)
N, BATCH, EPOCHS, SAVE_EVERY = 48, 4, 2, 3


class Data(torch.utils.data.Dataset):
    """Sample i: features derived from i, and i itself (so the loop can log which it saw)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        x = torch.arange(6, dtype=torch.float32) * 0.1 + i * 0.01
        return x, torch.tensor(i % 3), torch.tensor(i)


def train(out: str, root: str, workers: int, kill_at: int) -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    cursor = ckptcore.DataCursor(N, BATCH, seed=7)
    mgr = ckptcore.CheckpointManager(root)
    step = 0
    if mgr.latest_step() is not None:
        state = mgr.restore(cursor=cursor)
        with torch.no_grad():
            for name, p in net.named_parameters():
                p.copy_(torch.from_numpy(state.model[name]))
        step = state.step
    kwargs = {"num_workers": workers, "prefetch_factor": 2} if workers else {}
    loader = ckptcore_torch.DataLoader(Data(), cursor, **kwargs)
    with open(out + ".log", "a") as log:
        while cursor.epoch < EPOCHS:
            for x, y, ids in loader:
                loss = torch.nn.functional.cross_entropy(net(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                log.write(f"{step} {' '.join(map(str, ids.tolist()))}\n")
                log.flush()
                if step % SAVE_EVERY == 0:
                    model = {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}
                    mgr.save(step, ckptcore.TrainingState(model=model, step=step), cursor=cursor)
                if step == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()
    np.savez(out + ".npz", **{k: v.detach().numpy() for k, v in net.state_dict().items()})


def hold() -> None:
    loader = ckptcore_torch.DataLoader(Data(), ckptcore.DataCursor(N, BATCH, seed=7),
                                       num_workers=2, prefetch_factor=2)
    it = iter(loader)
    next(it)
    print(json.dumps([w.pid for w in it._workers]), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    if sys.argv[1] == "train":
        train(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        hold()

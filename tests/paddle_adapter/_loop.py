"""The natural Paddle loop, run as ``python _loop.py <out> <root> <workers> <stop> [<storage options JSON>]``.

``for x, y in ckptcore_paddle.DataLoader(ds, cursor, num_workers=<workers>):`` trains a small MLP
with dropout (so Paddle's RNG matters) and Adam with a scheduler, saving every ``SAVE_EVERY`` steps
through ``mgr.save(step, model=..., optimizer=..., cursor=...)`` in the middle of the body (the
loss is recorded after the save), and restores the newest checkpoint first if there is one.
``<stop>`` is:

* ``none``: run to the end of ``EPOCHS`` epochs;
* ``kill:<step>``: SIGKILL itself straight after the save at ``<step>`` (prefetched batches, the
  writer's lease and, with workers, the worker processes are all left behind);
* ``term:<step>``: SIGTERM itself during ``<step>``, before the optimizer step; the manager was
  made with ``save_on_preemption=True``, so the loop ends at ``mgr.save_if_preempted(...)``.

It writes ``<out>.json`` (the first step it trained, per-step losses as float32 bit patterns) and,
when it reaches the end, ``<out>.npz`` (parameters and optimizer accumulators via Paddle's APIs).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import paddle.nn.functional as F  # noqa: E402

import ckptcore  # noqa: E402
import ckptcore_paddle as cp  # noqa: E402
from _models import snapshot  # noqa: E402

N, BS, EPOCHS, SAVE_EVERY = 100, 8, 3, 4  # 13 batches an epoch, the last of 4


class Data(paddle.io.Dataset):
    def __init__(self):
        rs = np.random.RandomState(11)
        self.x, self.y = rs.randn(N, 6).astype("float32"), rs.randint(0, 3, (N, 1)).astype("int64")

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __len__(self):
        return N


def bits(value) -> int:
    return int(np.asarray(value, dtype=np.float32).reshape(()).view(np.uint32))


def main(out: str, root: str, workers: int, stop: str, options: dict) -> None:
    paddle.seed(3)
    np.random.seed(3)
    net = paddle.nn.Sequential(paddle.nn.Linear(6, 16), paddle.nn.ReLU(), paddle.nn.Dropout(0.3),
                               paddle.nn.Linear(16, 3))
    sch = paddle.optimizer.lr.StepDecay(0.01, step_size=10, gamma=0.5)
    opt = paddle.optimizer.Adam(learning_rate=sch, parameters=net.parameters())
    cursor = ckptcore.DataCursor(N, BS, seed=5)
    loader = cp.DataLoader(Data(), cursor, num_workers=workers)
    kind, _, at = stop.partition(":")
    extra = {"save_on_preemption": True} if kind == "term" else {}
    mgr = ckptcore.CheckpointManager(root, keep=None, storage_options=options, **extra)
    step = 0
    if mgr.latest_step() is not None:
        mgr.restore(model=net, optimizer=opt, cursor=cursor)
        step = mgr.latest_step()
    info = {"first": step, "losses": {}}
    at = int(at) if at else -1
    while cursor.epoch < EPOCHS:
        for x, y in loader:
            loss = F.cross_entropy(net(x), y).mean()
            loss.backward()
            if kind == "term" and step + 1 == at:
                os.kill(os.getpid(), signal.SIGTERM)  # the handler only notes it: the step goes on
            opt.step()
            opt.clear_grad()
            sch.step()
            step += 1
            if step % SAVE_EVERY == 0:  # in the middle of the body, not at its end
                mgr.save(step, model=net, optimizer=opt, cursor=loader if workers else cursor)
            info["losses"][str(step)] = bits(loss.numpy())
            with open(out + ".json", "w") as f:
                json.dump(info, f)
            if kind == "kill" and step == at:
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "term" and mgr.save_if_preempted(step, model=net, optimizer=opt, cursor=cursor):
                mgr.close()
                return
    mgr.close()
    np.savez(out + ".npz", **snapshot(net, opt))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4],
         json.loads(sys.argv[5]) if len(sys.argv) > 5 else {})

"""``python _dataparallel.py DIR``: two CPU processes (gloo) train a DataParallel model and each
pickles its capture to ``DIR/dp_rank<r>.pkl`` (test_paddle_restore.py compares and restores them)."""

from __future__ import annotations

import os
import pickle
import sys

import numpy as np
import paddle
import paddle.distributed as dist

import ckptcore_paddle as cp
from _models import Tiny, train_step


def _rank(d: str) -> None:
    dist.init_parallel_env()
    rank = dist.get_rank()
    paddle.seed(0)
    dp = paddle.DataParallel(Tiny())
    opt = paddle.optimizer.Adam(0.01, parameters=dp.parameters())
    rs = np.random.RandomState(rank)
    for _ in range(2):
        train_step(dp, opt, None, rs.randn(6, 4).astype("float32"))
    with open(os.path.join(d, f"dp_rank{rank}.pkl"), "wb") as f:
        pickle.dump(cp.capture(dp, opt, rng=False), f)


if __name__ == "__main__":
    dist.spawn(_rank, args=(sys.argv[1],), nprocs=2, backend="gloo")

"""The adapter conformance suite (ckptcore.testing.AdapterTests) for the Paddle adapter.

Unlike the other Paddle tests this imports Paddle into pytest's own process: run the folder in a
pytest process of its own (scripts/test.sh does), never together with the Keras tests.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytest.register_assert_rewrite("ckptcore.testing")  # before the import: its asserts explain themselves
from ckptcore.testing import AdapterTests  # noqa: E402

if importlib.util.find_spec("paddle") is None:  # not installed: skip; installed but broken: fail
    pytest.skip("paddlepaddle is not installed", allow_module_level=True)

import paddle  # noqa: E402

X = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
Y = np.random.default_rng(1).integers(0, 3, 16).astype(np.int64)


class TestPaddleConformance(AdapterTests):
    adapter_name = "paddle"

    def make(self, seed):
        paddle.seed(seed)
        net = paddle.nn.Sequential(paddle.nn.Linear(4, 8), paddle.nn.ReLU(), paddle.nn.Dropout(0.3),
                                   paddle.nn.Linear(8, 3))
        objects = {"model": net,
                   "optimizer": paddle.optimizer.Adam(learning_rate=0.01, parameters=net.parameters())}
        self.train(objects, 1)
        return objects

    def train(self, objects, steps):
        net, opt = objects["model"], objects["optimizer"]
        for _ in range(steps):
            loss = paddle.nn.functional.cross_entropy(net(paddle.to_tensor(X)), paddle.to_tensor(Y))
            loss.backward()
            opt.step()
            opt.clear_grad()

    def model_arrays(self, objects):
        return {k: np.array(v.numpy()) for k, v in objects["model"].state_dict().items()}

    def optimizer_arrays(self, objects):
        return {k: np.array(v.numpy()) for k, v in objects["optimizer"].state_dict().items()
                if hasattr(v, "numpy")}

    def draw_rng(self):
        return paddle.rand([4]).numpy()

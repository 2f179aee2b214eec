"""The adapter conformance suite (ckptcore.testing.AdapterTests) for the PyTorch adapter.

Imports torch into pytest's own process: run the folder in a pytest process of its own
(scripts/test.sh does), never together with the Keras or Paddle tests.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.register_assert_rewrite("ckptcore.testing")  # before the import: its asserts explain themselves
from ckptcore.testing import AdapterTests  # noqa: E402

if importlib.util.find_spec("torch") is None:  # not installed: skip; installed but broken: fail
    pytest.skip("torch is not installed", allow_module_level=True)

import torch  # noqa: E402
from _torch_models import X, Y, mlp  # noqa: E402


class TestTorchConformance(AdapterTests):
    adapter_name = "torch"

    def make(self, seed):
        net = mlp(seed)
        objects = {"model": net, "optimizer": torch.optim.Adam(net.parameters(), lr=0.01)}
        self.train(objects, 1)
        return objects

    def train(self, objects, steps):
        net, opt = objects["model"], objects["optimizer"]
        net.train()
        for _ in range(steps):
            torch.nn.functional.cross_entropy(net(X), Y).backward()
            opt.step()
            opt.zero_grad()

    def model_arrays(self, objects):
        return {k: v.detach().clone().numpy() for k, v in objects["model"].state_dict().items()}

    def optimizer_arrays(self, objects):
        sd = objects["optimizer"].state_dict()
        return {f"{i}/{k}": v.detach().clone().numpy() for i, st in sorted(sd["state"].items())
                for k, v in sorted(st.items())}

    def draw_rng(self):
        return torch.rand(4).numpy()

    def test_adapter_declares_the_contract(self):
        # The file formats (ckptcore_torch._files) land separately from capture/restore.
        import ckptcore_torch
        if not (Path(ckptcore_torch.__file__).parent / "_files.py").exists():
            pytest.skip("ckptcore_torch._files (the torch.save formats) is not there yet")
        super().test_adapter_declares_the_contract()

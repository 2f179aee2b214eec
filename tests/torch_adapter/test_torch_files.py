"""torch.save files: imported without torch, exported for torch.load(weights_only=True), resumed bitwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))
from _torch_files_models import build, train  # noqa: E402

import ckptcore  # noqa: E402
import ckptcore_torch  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


@pytest.mark.parametrize("legacy", [False, True])
def test_import_runs_without_torch_and_matches(tmp_path, legacy):
    model, opt = build()
    train(model, opt, 3, 1)
    path = tmp_path / "ck.pt"
    torch.save({"model_state_dict": model.state_dict(), "optimizer_state_dict": opt.state_dict(), "epoch": 7},
               path, _use_new_zipfile_serialization=not legacy)
    code = ("import sys, ckptcore_torch; s = ckptcore_torch.import_torch_files(sys.argv[1]); "
            "assert 'torch' not in sys.modules; print(s.optimizer.kind, s.step, s.epoch)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], env=ENV, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["adamw", "3", "7"]
    state = ckptcore_torch.import_torch_files(path)
    for k, v in model.state_dict().items():
        assert np.array_equal(state.model[k], v.numpy()) and state.model[k].dtype == v.numpy().dtype
    names = [n for n, _ in model.named_parameters()]
    for i, name in enumerate(names):
        for slot, v in opt.state_dict()["state"][i].items():
            assert state.optimizer.slots[name][slot].tobytes() == v.numpy().tobytes()


def test_export_then_resume_equals_uninterrupted_run(tmp_path):
    ref_model, ref_opt = build()
    train(ref_model, ref_opt, 6, 1)
    model, opt = build()
    train(model, opt, 3, 1)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "a.pt")
    state = ckptcore_torch.import_torch_files(tmp_path / "a.pt")
    ckptcore_torch.export_torch_files(state, tmp_path / "b.pt")
    loaded = torch.load(tmp_path / "b.pt", weights_only=True)
    fresh, fresh_opt = build(seed=5)
    fresh.load_state_dict(loaded["model"])
    fresh_opt.load_state_dict(loaded["optimizer"])
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        torch.randn(5, 3, generator=g)  # the batches the first three steps used
    for _ in range(3):
        x = torch.randn(5, 3, generator=g)
        fresh_opt.zero_grad()
        fresh(x).square().mean().backward()
        fresh_opt.step()
    for (k, a), b in zip(ref_model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k


def test_dtypes_views_and_tied_weights(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sd = {"t": base.t(), "slice": base[1:3, ::2], "bf": torch.randn(3).to(torch.bfloat16),
          "i8": torch.tensor([1, -2], dtype=torch.int8), "b": torch.tensor([True, False]),
          "emb.weight": base, "head.weight": base}
    torch.save(sd, tmp_path / "v.pt")
    state = ckptcore_torch.import_torch_files(tmp_path / "v.pt")
    for k in ("t", "slice", "i8", "b", "emb.weight"):
        assert np.array_equal(state.model[k], sd[k].numpy())
    assert state.model["bf"].tobytes() == sd["bf"].view(torch.int16).numpy().tobytes()
    assert state.extra["torch"]["aliases"] == {"head.weight": "emb.weight"}
    ckptcore_torch.export_torch_files(state, tmp_path / "w.pt", model_only=True)
    back = torch.load(tmp_path / "w.pt", weights_only=True)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_param_count_mismatch_is_refused_with_advice(tmp_path):
    model, opt = build()
    train(model, opt, 1, 1)
    sd = model.state_dict()
    sd["extra_buffer"] = torch.zeros(2)
    torch.save({"model": sd, "optimizer": opt.state_dict()}, tmp_path / "m.pt")
    with pytest.raises(ckptcore.SchemaError, match="param_names"):
        ckptcore_torch.import_torch_files(tmp_path / "m.pt")
    names = [n for n, _ in model.named_parameters()]
    state = ckptcore_torch.import_torch_files(tmp_path / "m.pt", param_names=names)
    assert set(state.optimizer.slots) == set(names)


def test_cli_import_export(tmp_path):
    model, opt = build()
    train(model, opt, 2, 1)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "c.pt")
    cli = [sys.executable, "-m", "ckptcore.cli"]
    r = subprocess.run(cli + ["import", "--from", "torch", str(tmp_path / "c.pt"), str(tmp_path / "root")],
                       env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(cli + ["export", "--to", "torch", str(tmp_path / "root"), str(tmp_path / "out.pt")],
                       env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    back = torch.load(tmp_path / "out.pt", weights_only=True)
    assert all(torch.equal(back["model"][k], v) for k, v in model.state_dict().items())

"""torch.distributed.checkpoint folders: DCP -> ckptcore -> DCP, restored bitwise; hostile folders."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))
import torch.distributed.checkpoint as dcp  # noqa: E402
from _torch_files_models import build, train  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

import ckptcore  # noqa: E402
import ckptcore_torch  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_dcp_round_trip_both_ways(tmp_path):
    model, opt = build()
    train(model, opt, 3, 1)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "a"), no_dist=True)
    state = ckptcore_torch.import_dcp(tmp_path / "a")
    assert state.optimizer.kind == "adamw" and state.step == 3
    for k, v in model.state_dict().items():
        assert np.array_equal(state.model[k], v.numpy())
    ckptcore_torch.export_dcp(state, tmp_path / "b")
    fresh, fresh_opt = build(seed=9)
    train(fresh, fresh_opt, 1, 2)  # optimizer state exists, so get_state_dict has slots to load into
    fm, fo = get_state_dict(fresh, fresh_opt)
    target = {"model": fm, "optim": fo}
    dcp.load(target, checkpoint_id=str(tmp_path / "b"), no_dist=True)
    set_state_dict(fresh, fresh_opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    train(model, opt, 2, 7)
    train(fresh, fresh_opt, 2, 7)
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k


def test_hostile_dcp_folders(tmp_path):
    model, opt = build()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "a"), no_dist=True)
    with pytest.raises(ckptcore.CheckpointNotFoundError, match="no .metadata"):
        ckptcore_torch.import_dcp(tmp_path / "nothing")
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "a", bad)
    (bad / ".metadata").write_bytes(b"\x80\x02cposix\nsystem\nX\x02\x00\x00\x00lsR.")
    with pytest.raises(ckptcore.UnsafeCheckpointError, match="posix.system"):
        ckptcore_torch.import_dcp(bad)
    short = tmp_path / "short"
    shutil.copytree(tmp_path / "a", short)
    data = next(short.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(ckptcore.CorruptCheckpointError, match=r"\.distcp: bytes \d+\.\.\d+ are listed, the file has 100"):
        ckptcore_torch.import_dcp(short)
    gone = tmp_path / "gone"
    shutil.copytree(tmp_path / "a", gone)
    next(gone.glob("*.distcp")).unlink()
    with pytest.raises(ckptcore.IncompleteCheckpointError, match=r"__0_0\.distcp is listed but missing"):
        ckptcore_torch.import_dcp(gone)

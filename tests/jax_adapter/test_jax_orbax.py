"""Orbax interop: ``import_orbax`` reads StandardCheckpointer / CheckpointManager steps (OCDBT or
plain folders, zarr v2 or zarr3, sharded or not) through TensorStore, ``export_orbax`` writes
checkpoints Orbax restores into a target pytree bit for bit, ``ckpt import --from orbax`` /
``ckpt export --to orbax``, and hostile folders give only CheckpointErrors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")
ocp = pytest.importorskip("orbax.checkpoint")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _jax_models import X, Y, make_step, params, tree_arrays  # noqa: E402
from _support import subprocess_env  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ckptcore  # noqa: E402
import ckptcore_jax  # noqa: E402
from ckptcore.errors import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError,  # noqa: E402
                             CorruptCheckpointError, SchemaError, UnsafeCheckpointError)

TX = optax.adam(0.01)


def _trained(seed=0, steps=2):
    p = params(seed)
    s = TX.init(p)
    step = make_step(TX)
    for _ in range(steps):
        p, s = step(p, s, X, Y)
    return {"params": p, "opt_state": s, "step": steps}


def _target(seed=1):
    p = params(seed)
    return {"params": p, "opt_state": TX.init(p), "step": 0}


def _save(path, tree, *, ocdbt=True, zarr3=False):
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3)) as c:
        c.save(os.fspath(path), args=ocp.args.PyTreeSave(tree))


@pytest.mark.parametrize("ocdbt,zarr3", [(True, False), (False, False), (True, True), (False, True)])
def test_import_orbax_restores_into_live_objects_bitwise(tmp_path, ocdbt, zarr3):
    tree = _trained()
    _save(tmp_path / "orb", tree, ocdbt=ocdbt, zarr3=zarr3)
    state = ckptcore_jax.import_orbax(tmp_path / "orb")
    assert state.step == 2 and state.framework == "jax"
    assert set(state.optimizer.slots["dense/kernel"]) == {"0/mu", "0/nu"}
    assert state.model["head/bias"].dtype == jnp.bfloat16
    target = _target()
    m, o = ckptcore_jax.Ref(target["params"]), ckptcore_jax.Ref(target["opt_state"])
    assert ckptcore_jax.restore(state, m, o).ok
    assert tree_arrays(m.value).keys() == tree_arrays(tree["params"]).keys()
    for got, want in ((m.value, tree["params"]), (o.value, tree["opt_state"])):
        for (k, a), b in zip(tree_arrays(got).items(), tree_arrays(want).values()):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), k


def test_standard_checkpointer_manager_steps_and_sharded_arrays(tmp_path):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    w = jax.device_put(np.arange(48, dtype=np.float32).reshape(8, 6), NamedSharding(mesh, P("a", "b")))
    key = jax.random.key(7)
    with ocp.CheckpointManager(os.fspath(tmp_path / "mgr")) as mgr:
        for step in (1, 2):
            mgr.save(step, args=ocp.args.StandardSave({"params": {"w": w * step, "key": key}, "step": step}))
        mgr.wait_until_finished()
    newest = ckptcore_jax.import_orbax(tmp_path / "mgr")
    assert newest.step == 2 and newest.model["w"].tobytes() == (np.asarray(w) * 2).tobytes()
    assert newest.extra["jax"]["keys"] == {"key": "threefry2x32"}
    assert np.array_equal(newest.model["key"], jax.random.key_data(key))
    first = ckptcore_jax.import_orbax(tmp_path / "mgr", step=1)
    assert first.model["w"].tobytes() == np.asarray(w).tobytes()
    assert ckptcore_jax.import_orbax(tmp_path / "mgr" / "2").step == 2  # a step folder
    with pytest.raises(CheckpointNotFoundError, match="no committed Orbax step 5"):
        ckptcore_jax.import_orbax(tmp_path / "mgr", step=5)
    # the typed key goes back into a typed key
    target = ckptcore_jax.Ref({"key": jax.random.key(0), "w": jnp.zeros((8, 6))})
    ckptcore_jax.restore(newest, target)
    assert np.array_equal(jax.random.key_data(target.value["key"]), jax.random.key_data(key))


def test_an_nnx_state_saved_as_it_is(tmp_path):
    from _jax_models import model_arrays, net
    from flax import nnx

    model = net(0)
    with ocp.StandardCheckpointer() as c:
        c.save(os.fspath(tmp_path / "nnx"), nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat)))
        c.wait_until_finished()
    state = ckptcore_jax.import_orbax(tmp_path / "nnx")
    assert {"lin/kernel", "bn/mean"} <= set(state.model), sorted(state.model)
    other = net(1)
    report = ckptcore_jax.restore(state, other, rng=False)
    assert report.ok, report
    for (k, a), b in zip(model_arrays(model).items(), model_arrays(other).values()):
        assert a.tobytes() == b.tobytes(), k


@pytest.mark.parametrize("ocdbt,zarr3", [(True, False), (False, True)])
def test_export_orbax_restores_in_orbax_bitwise(tmp_path, ocdbt, zarr3):
    tree = _trained()
    state = ckptcore_jax.capture(ckptcore_jax.Ref(tree["params"]), ckptcore_jax.Ref(tree["opt_state"]),
                                 step=2, rng=False)
    ckptcore.save_state(str(tmp_path / "ck"), state)
    loaded = ckptcore.load_state(str(tmp_path / "ck"))
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    target = _target()
    target["params"]["dense"]["kernel"] = jax.device_put(target["params"]["dense"]["kernel"],
                                                         NamedSharding(mesh, P("b", "a")))
    out = ckptcore_jax.export_orbax(loaded, tmp_path / "orb", target=target, ocdbt=ocdbt, zarr3=zarr3)
    with ocp.StandardCheckpointer() as c:
        restored = c.restore(out, target)
    assert restored["params"]["dense"]["kernel"].sharding == target["params"]["dense"]["kernel"].sharding
    assert int(restored["step"]) == 2
    for part in ("params", "opt_state"):
        a, b = tree_arrays(restored[part]), tree_arrays(tree[part])
        for k in b:
            assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k
    # without a target: nested dicts Orbax restores as they are, and that import_orbax reads back
    plain = ckptcore_jax.export_orbax(loaded, tmp_path / "plain")
    back = ckptcore_jax.import_orbax(plain)
    assert back.model.keys() == loaded.model.keys() and back.step == 2
    assert all(back.model[k].tobytes() == loaded.model[k].tobytes() for k in loaded.model)
    assert back.optimizer.slots.keys() == loaded.optimizer.slots.keys()
    # something already there: refused with a typed error, replaced only when asked
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        ckptcore_jax.export_orbax(loaded, tmp_path / "plain")
    assert ckptcore_jax.import_orbax(plain).step == 2  # untouched
    loaded.step = 3
    ckptcore_jax.export_orbax(loaded, tmp_path / "plain", overwrite=True)
    assert ckptcore_jax.import_orbax(plain).step == 3


def test_ckpt_import_and_export_verbs(tmp_path):
    _save(tmp_path / "orb", _trained())
    env = subprocess_env()
    run = [sys.executable, "-m", "ckptcore.cli"]
    r = subprocess.run([*run, "import", "--from", "orbax", str(tmp_path / "orb"), str(tmp_path / "ck")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    state = ckptcore.load_state(str(tmp_path / "ck"))
    assert state.step == 2 and "dense/kernel" in state.model
    r = subprocess.run([*run, "export", "--to", "orbax", str(tmp_path / "ck"), str(tmp_path / "again")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ckptcore_jax.import_orbax(tmp_path / "again").model.keys() == state.model.keys()


# --- hostile folders ----------------------------------------------------------------------------


@pytest.fixture
def plain(tmp_path):
    _save(tmp_path / "p", {"params": {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}}, ocdbt=False)
    return tmp_path / "p"


def _metadata(folder):
    return json.loads((folder / "_METADATA").read_text())


def test_links_fifos_and_missing_folders(plain, tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        ckptcore_jax.import_orbax(tmp_path / "nothing")
    os.symlink("/etc/passwd", plain / "params.w" / "1")
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        ckptcore_jax.import_orbax(plain)
    os.unlink(plain / "params.w" / "1")
    os.mkfifo(plain / "params.b" / "fifo")
    with pytest.raises(UnsafeCheckpointError, match="FIFO"):
        ckptcore_jax.import_orbax(plain)
    os.unlink(plain / "params.b" / "fifo")
    os.symlink(plain, tmp_path / "link")
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        ckptcore_jax.import_orbax(tmp_path / "link")
    assert ckptcore_jax.import_orbax(plain).model["w"].shape == (2, 3)


@pytest.mark.parametrize("edit,error,match", [
    (lambda m: m["tree_metadata"][next(iter(m["tree_metadata"]))]["key_metadata"].__setitem__(
        1, {"key": "..", "key_type": 2}), UnsafeCheckpointError, "not a plain name"),
    (lambda m: m["tree_metadata"][next(iter(m["tree_metadata"]))]["key_metadata"].__setitem__(
        1, {"key": "../../etc", "key_type": 2}), UnsafeCheckpointError, "not a plain name"),
    (lambda m: m["tree_metadata"][next(iter(m["tree_metadata"]))]["value_metadata"].__setitem__(
        "value_type", "pickle"), SchemaError, "value_type 'pickle'"),
    (lambda m: m.__setitem__("tree_metadata", []), SchemaError, "tree_metadata"),
])
def test_hostile_metadata(plain, edit, error, match):
    meta = _metadata(plain)
    edit(meta)
    (plain / "_METADATA").write_text(json.dumps(meta))
    with pytest.raises(error, match=match):
        ckptcore_jax.import_orbax(plain)


def test_metadata_that_is_not_json_or_too_large(plain):
    (plain / "_METADATA").write_bytes(b"\x80{not json")
    with pytest.raises(SchemaError, match="not JSON"):
        ckptcore_jax.import_orbax(plain)
    (plain / "_METADATA").write_bytes(b" " * 5000)
    from ckptcore.adapter import knobs
    with knobs.override(max_manifest_bytes=4096), \
            pytest.raises(UnsafeCheckpointError, match="bytes of tree metadata"):
        ckptcore_jax.import_orbax(plain)


def test_huge_declared_shapes_and_damaged_data(plain):
    zarray = plain / "params.w" / ".zarray"
    good = zarray.read_text()
    meta = json.loads(good)
    meta["shape"], meta["chunks"] = [10**9, 10**9], [1, 1]
    zarray.write_text(json.dumps(meta))
    with pytest.raises(UnsafeCheckpointError, match="max_bytes"):
        ckptcore_jax.import_orbax(plain)
    zarray.write_text(good)
    with pytest.raises(UnsafeCheckpointError, match="max_bytes"):
        ckptcore_jax.import_orbax(plain, max_bytes=16)
    meta = json.loads(good)
    meta["dtype"] = "|O"
    zarray.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError):
        ckptcore_jax.import_orbax(plain)
    zarray.write_text(good)
    chunk = next(p for p in (plain / "params.w").iterdir() if not p.name.startswith("."))
    chunk.write_bytes(b"garbage" * 3)
    with pytest.raises(CorruptCheckpointError, match="params.w"):
        ckptcore_jax.import_orbax(plain)


def test_code_named_in_metadata_is_only_data(tmp_path):
    _save(tmp_path / "o", {"params": {"w": jnp.arange(3.0)}})
    marker = tmp_path / "ran"
    meta = json.loads((tmp_path / "o" / "_CHECKPOINT_METADATA").read_text())
    meta["item_handlers"] = f"os.system('touch {marker}')"
    (tmp_path / "o" / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))
    tree = _metadata(tmp_path / "o")
    tree["custom_metadata"] = {"__reduce__": "os.system", "restore_type": "builtins.eval"}
    (tmp_path / "o" / "_METADATA").write_text(json.dumps(tree))
    assert ckptcore_jax.import_orbax(tmp_path / "o").model["w"].tolist() == [0.0, 1.0, 2.0]
    assert not marker.exists()


def test_a_damaged_ocdbt_manifest(tmp_path):
    _save(tmp_path / "o", {"params": {"w": jnp.arange(3.0)}})
    (tmp_path / "o" / "manifest.ocdbt").write_bytes(b"\x00garbage" * 4)
    with pytest.raises(CorruptCheckpointError):
        ckptcore_jax.import_orbax(tmp_path / "o")


def test_a_multi_process_orbax_save_imports_bitwise_and_an_export_restores_in_a_job(tmp_path):
    """Two processes of a ``jax.distributed`` job (4 CPU devices each, one mesh over the 8) save
    with Orbax, each writing the shards it holds (OCDBT: a database per process; plain zarr3:
    both into one folder per array): ``import_orbax`` reads both bitwise.  A checkpoint that
    ``export_orbax`` wrote in one process restores through Orbax in the job, every shard in place."""
    from _jax_group_worker import SHAPES, expected
    from _jax_ranks import launch

    want = expected()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    params = {k: jax.device_put(want[k], NamedSharding(mesh, P(*spec))) for k, (_, spec) in SHAPES.items()}
    opt = {"mu": {"w": params["w"]}, "count": jnp.asarray(want["count"])}
    state = ckptcore_jax.capture(ckptcore_jax.Ref(params), ckptcore_jax.Ref(opt), rng=False, step=7)
    ckptcore_jax.export_orbax(state, tmp_path / "exported",
                              target={"params": params, "opt_state": opt, "step": 0})
    out = launch("_jax_group_worker.py", 2, "orbax", tmp_path)
    assert [(o["result"]["step"], o["result"]["checked"] > 0) for o in out] == [(7, True), (7, True)]
    assert sorted(p.name for p in (tmp_path / "ocdbt").glob("ocdbt.process_*")) == [
        "ocdbt.process_0", "ocdbt.process_1"]  # each process wrote its own shards
    for layout in ("ocdbt", "zarr3"):
        got = ckptcore_jax.import_orbax(tmp_path / layout)
        assert got.step == 7, layout
        for k in SHAPES:
            assert got.model[k].dtype == want[k].dtype and got.model[k].tobytes() == want[k].tobytes(), (layout, k)
        assert got.optimizer.slots["w"]["mu"].tobytes() == want["w"].tobytes()
        assert got.optimizer.extra["leaves"]["count"].tobytes() == want["count"].tobytes()
    # and into live arrays laid out over 4 devices of this process
    small = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    live = {k: jax.device_put(np.zeros(s, np.float32), NamedSharding(small, P(*spec)))
            for k, (s, spec) in SHAPES.items()}
    target = ckptcore_jax.Ref(live)
    moments = ckptcore_jax.Ref({"mu": {"w": live["w"]}, "count": jnp.zeros((), jnp.int32)})
    assert ckptcore_jax.restore(got, target, moments, rng=False).ok
    for k in SHAPES:
        assert target.value[k].sharding == live[k].sharding
        assert np.asarray(target.value[k]).tobytes() == want[k].tobytes(), k
    assert np.asarray(moments.value["mu"]["w"]).tobytes() == want["w"].tobytes()
    assert int(moments.value["count"]) == 5

"""Sharded ``jax.Array``s on eight CPU devices (conftest.py sets the flag): captured as
``ckptcore.Shard``/``Chunks`` leaves, each distinct block once (replicas once), saved through a
real directory and restored into other meshes (8 devices -> 4 -> 1, in one process) bit for
bit, with the target's sharding, reading only the blocks each device needs (``like=``)."""

from __future__ import annotations

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ckptcore  # noqa: E402
import ckptcore_jax  # noqa: E402
from ckptcore.sharding import Chunks, Shard  # noqa: E402

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 CPU devices (XLA_FLAGS)")

SPECS = {"w": P("a", "b"), "rows": P("a", None), "cols": P(None, "b"), "bias": P(), "odd": P("a")}
SHAPES = {"w": (8, 6), "rows": (8, 5), "cols": (3, 6), "bias": (6,), "odd": (12,)}


def _mesh(n: int) -> Mesh:
    shape = {8: (4, 2), 4: (2, 2), 1: (1, 1)}[n]
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), ("a", "b"))


def _tree(mesh: Mesh, fill: bool = True) -> dict:
    g = np.random.default_rng(0)
    out = {}
    for k, shape in SHAPES.items():
        value = g.standard_normal(shape).astype(np.float32) if fill else np.zeros(shape, np.float32)
        out[k] = jax.device_put(value, NamedSharding(mesh, SPECS[k]))
    out["step_bf16"] = jax.device_put(jnp.arange(16, dtype=jnp.bfloat16).reshape(4, 4),
                                      NamedSharding(mesh, P("b", "a")))
    return out


def _whole(tree: dict) -> dict:
    return {k: np.asarray(v) for k, v in tree.items()}


def test_capture_writes_each_block_once():
    tree = _tree(_mesh(8))
    state = ckptcore_jax.capture(ckptcore_jax.Ref(tree), rng=False)
    w = state.model["w"]
    assert isinstance(w, Chunks) and len(w.parts) == 8 and w.global_shape == (8, 6)
    rows = state.model["rows"]  # 4 blocks over a, each replicated twice over b: written once each
    assert isinstance(rows, Chunks) and len(rows.parts) == 4
    assert sorted(p.offsets for p in rows.parts) == [(0, 0), (2, 0), (4, 0), (6, 0)]
    assert isinstance(state.model["cols"], Chunks) and len(state.model["cols"].parts) == 2
    assert isinstance(state.model["bias"], np.ndarray)  # fully replicated: one plain array
    whole = _whole(tree)
    for name in ("w", "rows", "cols", "odd"):
        for part in state.model[name].parts:
            assert isinstance(part, Shard)
            assert part.data.tobytes() == whole[name][part.index()].tobytes(), name


@pytest.mark.parametrize("target_devices", [8, 4, 1])
@pytest.mark.parametrize("use_like", [True, False])
def test_restore_into_another_mesh_bitwise(tmp_path, target_devices, use_like):
    source = _tree(_mesh(8))
    url = str(tmp_path / "ckpt")
    ckptcore.save_state(url, model=ckptcore_jax.Ref(source), rng=False)
    target = ckptcore_jax.Ref(_tree(_mesh(target_devices), fill=False))
    like = ckptcore_jax.template(target) if use_like else None
    if use_like and target_devices > 1:
        assert isinstance(like.model["w"], (Shard, Chunks))
    ckptcore.load_state(url, model=target, like=like)
    fresh = _tree(_mesh(target_devices), fill=False)
    for k, v in target.value.items():
        assert v.sharding == fresh[k].sharding, k
        assert np.asarray(v).dtype == np.asarray(source[k]).dtype
        assert np.asarray(v).tobytes() == np.asarray(source[k]).tobytes(), k


def test_like_reads_only_the_blocks_asked_for(tmp_path):
    source = _tree(_mesh(8))
    url = str(tmp_path / "ckpt")
    ckptcore.save_state(url, model=ckptcore_jax.Ref(source), rng=False)
    one = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("a", "b"))
    # Two devices holding only the first half of "rows": the load returns just those blocks.
    half = jax.device_put(np.zeros((8, 5), np.float32), NamedSharding(one, P("a", None)))
    like = ckptcore_jax.template({"rows": half})
    state = ckptcore.load_state(url, like=like)
    rows = state.model["rows"]
    assert isinstance(rows, Chunks) and [p.shape for p in rows.parts] == [(4, 5), (4, 5)]
    assert np.concatenate([p.data for p in rows.parts]).tobytes() == np.asarray(source["rows"]).tobytes()


def test_sharded_adam_resumes_on_another_mesh(tmp_path):
    """Params and Adam's moments sharded over 8 devices, saved, restored over 4 and 1: every
    leaf bitwise, each on its target sharding (Adam's count, which JAX placed itself, stays
    uncommitted: it follows the moments to their devices), and training goes on from there."""
    tx = optax.adam(0.01)

    def make(n, fill=True):
        m = _mesh(n)
        p = {"w": jax.device_put(np.random.default_rng(1).standard_normal((8, 6)).astype(np.float32) * fill,
                                 NamedSharding(m, P("a", "b")))}
        return p, tx.init(p)

    p, s = make(8)
    grad = jax.grad(lambda q: jnp.sum(jnp.sin(q["w"])))
    for _ in range(2):
        u, s = tx.update(grad(p), s, p)
        p = optax.apply_updates(p, u)
    url = str(tmp_path / "ckpt")
    ckptcore.save_state(url, model=ckptcore_jax.Ref(p), optimizer=ckptcore_jax.Ref(s), rng=False)
    for n in (4, 1):
        tp, ts = make(n, fill=False)
        mref, oref = ckptcore_jax.Ref(tp), ckptcore_jax.Ref(ts)
        ckptcore.load_state(url, model=mref, optimizer=oref, like=ckptcore_jax.template(mref, oref))
        for got, want, like in ((mref.value, p, tp), (oref.value, s, ts)):
            for g, w, lk in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(like)):
                assert g.sharding == lk.sharding and g.committed == lk.committed
                assert np.asarray(g).tobytes() == np.asarray(w).tobytes()
        u, _ = tx.update(grad(mref.value), oref.value, mref.value)
        assert np.isfinite(np.asarray(optax.apply_updates(mref.value, u)["w"])).all()


def _spec(v):
    """lin/kernel (6, 8) over both mesh axes, out/kernel (8, 3) over a (replicated over b),
    vectors of 8 over a, everything else replicated."""
    shape = getattr(v, "shape", ())
    if len(shape) == 2:
        return P("b", "a") if shape[1] % 4 == 0 else P("a", None)
    return P("a") if len(shape) == 1 and shape[0] % 4 == 0 else P()


def test_sharded_nnx_model_and_optimizer_move_between_meshes(tmp_path):
    """An NNX model whose kernels are sharded over 8 devices (and its nnx.Optimizer's moments,
    created from them), saved, then loaded into the same model laid out over 4 devices and over
    one: every variable bitwise on its new sharding."""
    from _jax_models import net, nnx_arrays
    from flax import nnx

    def laid_out(n, seed):
        model = net(seed)
        mesh = _mesh(n)
        state = nnx.state(model)
        specs = jax.tree.map(_spec, state)
        nnx.update(model, jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)))
        return {"model": model, "optimizer": nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)}

    src = laid_out(8, 0)
    kernel = src["model"].lin.kernel.get_value()
    assert len(kernel.sharding.device_set) == 8
    assert isinstance(ckptcore_jax.capture(**src).optimizer.slots["lin/kernel"]["0/mu"], Chunks)
    url = str(tmp_path / "ckpt")
    ckptcore.save_state(url, **src)
    for n in (4, 1):
        dst = laid_out(n, 1)
        shardings = {k: v.sharding for k, v in jax.tree_util.tree_leaves_with_path(nnx.state(dst["model"]))}
        ckptcore.load_state(url, **dst, like=ckptcore_jax.template(dst["model"], dst["optimizer"]))
        assert {k: v.sharding for k, v in jax.tree_util.tree_leaves_with_path(nnx.state(dst["model"]))} == shardings
        for obj in ("model", "optimizer"):
            a, b = nnx_arrays(src[obj]), nnx_arrays(dst[obj])
            assert list(a) == list(b)
            for k in a:
                assert a[k].tobytes() == b[k].tobytes(), (n, obj, k)


def test_the_registry_finds_the_adapter_for_a_pytree_of_jax_arrays():
    from ckptcore.registry import adapter_for

    assert adapter_for({"dense": {"kernel": jnp.zeros(2)}}) is ckptcore_jax.ADAPTER
    assert adapter_for([jnp.zeros(2)]) is ckptcore_jax.ADAPTER
    assert adapter_for({"w": jax.ShapeDtypeStruct((2,), jnp.float32)}) is ckptcore_jax.ADAPTER


def test_checkpoint_manager_restores_into_another_mesh(tmp_path):
    source = _tree(_mesh(8))
    with ckptcore.CheckpointManager(str(tmp_path / "run"), keep=2, async_save=True) as mgr:
        mgr.save(1, model=ckptcore_jax.Ref(source), rng=False)
        mgr.wait()
        assert mgr.latest_step() == 1
        target = ckptcore_jax.Ref(_tree(_mesh(4), fill=False))
        mgr.restore(model=target, like=ckptcore_jax.template(target))
    for k, v in target.value.items():
        assert np.asarray(v).tobytes() == np.asarray(source[k]).tobytes(), k
        assert len(v.sharding.device_set) in (1, 4)


def test_restore_into_abstract_targets(tmp_path):
    """Abstract leaves (``jax.ShapeDtypeStruct``, what ``jax.eval_shape`` and ``nnx.eval_shape``
    give, and what Orbax restores into) take the restored arrays without being allocated first:
    a sharded leaf on its own sharding (reading only its blocks with like=), a typed key, an
    Optax state; an abstract NNX model and optimizer bitwise, training on alike.  Saving an
    abstract leaf is a CaptureError."""
    from _jax_models import net, nnx_arrays, nnx_objects, train_nnx
    from flax import nnx

    from ckptcore.errors import CaptureError

    tx = optax.adam(0.01)
    source = _tree(_mesh(8))
    key = jax.random.key(3)
    url = str(tmp_path / "tree")
    ckptcore.save_state(url, model=ckptcore_jax.Ref({**source, "key": key}),
                        optimizer=ckptcore_jax.Ref(tx.init(source)), rng=False)
    small = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("a", "b"))
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(small, SPECS.get(k, P())))
                for k, v in source.items()}
    abstract["key"] = jax.eval_shape(lambda: key)
    m = ckptcore_jax.Ref(abstract)
    o = ckptcore_jax.Ref(jax.eval_shape(tx.init, {k: v for k, v in abstract.items() if k != "key"}))
    like = ckptcore_jax.template(m, o)
    assert isinstance(like.model["w"], (Shard, Chunks))  # only this process's blocks are read
    assert ckptcore.load_state(url, model=m, optimizer=o, like=like) is not None
    for k, v in source.items():
        assert isinstance(m.value[k], jax.Array) and m.value[k].sharding == abstract[k].sharding, k
        assert np.asarray(m.value[k]).tobytes() == np.asarray(v).tobytes(), k
    assert np.array_equal(jax.random.key_data(m.value["key"]), jax.random.key_data(key))
    assert int(o.value[0].count) == 0 and isinstance(o.value[0].mu["w"], jax.Array)

    src = nnx_objects(0)
    train_nnx(src, 2)
    ckptcore.save_state(str(tmp_path / "nnx"), **src)
    dst = nnx.eval_shape(lambda: nnx_objects(1))
    ckptcore.load_state(str(tmp_path / "nnx"), **dst)
    for objects in (src, dst):
        train_nnx(objects, 1)  # Dropout draws from the restored stream
    for obj in ("model", "optimizer"):
        a, b = nnx_arrays(src[obj]), nnx_arrays(dst[obj])
        assert list(a) == list(b) and all(a[k].tobytes() == b[k].tobytes() for k in a), obj
    with pytest.raises(CaptureError, match="abstract leaf"):
        ckptcore.save_state(str(tmp_path / "nothing"), model=nnx.eval_shape(lambda: net(0)))

"""Leaves that are not plain strongly typed arrays, through real checkpoint directories: NNX
Variables holding nothing (``None``, an empty tuple, the ``MaskedNode`` Optax leaves in a masked
optimizer state), values no restore could put back (refused when saved), NumPy scalars (back as
themselves, bit for bit), and weakly typed arrays (``jnp.asarray(0.5)``), which must come back
weak, with the target's sharding, for a resumed run to compute what the first one did
(``bfloat16 * weak`` stays bfloat16)."""

from __future__ import annotations

import os
import re

import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _jax_models import X, assert_same, nnx_arrays, nnx_objects, train_nnx  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ckptcore  # noqa: E402
import ckptcore_jax  # noqa: E402
from ckptcore.errors import CaptureError, RestoreError  # noqa: E402

needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 CPU devices (XLA_FLAGS)")

# Kernels trained, biases and BatchNorm's scale/bias frozen: a MaskedNode for each frozen one.
FROZEN_BIASES = optax.multi_transform(
    {"train": optax.adam(0.01), "freeze": optax.set_to_zero()},
    lambda p: jax.tree.map(lambda x: "train" if x.ndim > 1 else "freeze", p))


def _both(objects):
    return {**{f"model/{k}": v for k, v in nnx_arrays(objects["model"]).items()},
            **{f"opt/{k}": v for k, v in nnx_arrays(objects["optimizer"]).items()}}


def _masked_names(optimizer):
    """The optimizer's Variables holding a MaskedNode, named as the adapter names leaves."""
    return ["/".join(str(k) for k in path if k != "opt_state")
            for path, node in nnx.iter_graph(optimizer)
            if isinstance(node, nnx.Variable) and isinstance(node.get_value(), optax.MaskedNode)]


def test_a_multi_transform_optimizer_saves_no_placeholders_and_restores_bitwise(tmp_path):
    run = nnx_objects(0, FROZEN_BIASES)
    train_nnx(run, 2)
    masked = _masked_names(run["optimizer"])
    assert "inner_states/train/inner_state/0/mu/lin/bias" in masked
    path = str(tmp_path / "ckpt")
    ckptcore.save_state(path, **run)
    saved = ckptcore.load_state(path)
    assert not set(masked) & set(saved.optimizer.extra["leaves"])
    assert all(np.size(v) for v in saved.optimizer.extra["leaves"].values())
    assert set(saved.optimizer.slots) == {"lin/kernel", "out/kernel"}
    fresh = nnx_objects(1, FROZEN_BIASES)
    ckptcore.load_state(path, **fresh)   # strict: every name on both sides
    assert_same(_both(run), _both(fresh), "restored")
    after = dict(_leaf_values(fresh["optimizer"]))
    for name in masked:   # the placeholders are as they were: Optax's update needs them
        assert isinstance(after[name], optax.MaskedNode), name


def _leaf_values(optimizer):
    for path, node in nnx.iter_graph(optimizer):
        if isinstance(node, nnx.Variable):
            yield "/".join(str(k) for k in path if k != "opt_state"), node.get_value()


def test_a_checkpoint_that_saved_the_placeholders_as_empty_arrays_restores(tmp_path):
    """Before, each MaskedNode was saved as an empty float64 array, which no restore accepted:
    such a checkpoint restores now, and a real array under such a name is still unexpected."""
    run = nnx_objects(0, FROZEN_BIASES)
    train_nnx(run, 2)
    state = ckptcore_jax.capture(**run)
    for name in _masked_names(run["optimizer"]):
        state.optimizer.extra["leaves"][name] = np.array(optax.MaskedNode())  # float64[0], as then
    ckptcore.save_state(str(tmp_path / "old"), state)
    fresh = nnx_objects(1, FROZEN_BIASES)
    ckptcore.load_state(str(tmp_path / "old"), **fresh)
    assert_same(_both(run), _both(fresh), "restored")
    name = _masked_names(run["optimizer"])[0]
    state.optimizer.extra["leaves"][name] = np.ones(3, np.float32)
    with pytest.raises(RestoreError, match=re.escape(f"optimizer/{name}")):
        ckptcore_jax.restore(state, **nnx_objects(2, FROZEN_BIASES))


class _Holder(nnx.Module):
    def __init__(self, seed: int, value) -> None:
        self.lin = nnx.Linear(2, 3, rngs=nnx.Rngs(seed))
        self.v = nnx.Variable(value)


def test_variables_holding_nothing_are_no_leaves(tmp_path):
    src, dst = _Holder(0, None), _Holder(1, None)
    src.empty, dst.empty = nnx.Variable(()), nnx.Variable(())
    state = ckptcore_jax.capture(src)
    assert set(state.model) == {"lin/kernel", "lin/bias"}
    ckptcore.save_state(str(tmp_path / "c"), model=src)
    ckptcore.load_state(str(tmp_path / "c"), model=dst)
    assert_same(nnx_arrays(src), nnx_arrays(dst), "model")
    assert dst.v.get_value() is None and dst.empty.get_value() == ()


@pytest.mark.parametrize("make, name, what", [
    (lambda: _Holder(0, "hello"), "v", "builtins.str"),
    (lambda: _Holder(0, (jnp.ones(2), jnp.zeros(1))), "v", "builtins.tuple"),
    (lambda: ckptcore_jax.Ref({"w": jnp.ones(2), "tag": "run-1"}), "tag", "builtins.str"),
])
def test_a_value_no_restore_could_put_back_is_refused_when_saved(make, name, what, tmp_path):
    path = str(tmp_path / "c")
    with pytest.raises(CaptureError, match=f"^{name}: a leaf of type {what} cannot be saved"):
        ckptcore.save_state(path, model=make())
    assert not os.path.exists(path)


def test_numpy_scalar_leaves_come_back_as_themselves(tmp_path):
    # np.float64 is a Python float too: it comes back as np.float64, its NaN payload kept.
    nan = np.array(0x7FF8_0000_0000_0123, np.uint64).view(np.float64)[()]
    src = {"w": jnp.arange(3.0), "f32": np.float32(1.25), "i64": np.int64(-7), "u8": np.uint8(200),
           "f64": np.float64(nan), "b": np.bool_(True), "c64": np.complex64(1 - 2j)}
    ckptcore.save_state(str(tmp_path / "c"), model=ckptcore_jax.Ref(src))
    dst = ckptcore_jax.Ref({k: type(v)(0) if isinstance(v, np.generic) else jnp.zeros(3)
                            for k, v in src.items()})
    ckptcore.load_state(str(tmp_path / "c"), model=dst)
    for k, v in src.items():
        got = dst.value[k]
        assert type(got) is type(v), k
        assert np.asarray(got).tobytes() == np.asarray(v).tobytes(), k


# --- weak types ---------------------------------------------------------------------------------


class _WeakNet(nnx.Module):
    """A bfloat16 layer scaled by a fixed scalar made from a Python float (weakly typed; not a
    Param, so Optax's updates, which cast to a strong dtype, never touch it)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(X.shape[1], 3, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)
        self.temperature = nnx.Variable(jnp.asarray(0.5))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.lin(x.astype(jnp.bfloat16)) * self.temperature


def _weak_objects(seed: int) -> dict:
    model = _WeakNet(nnx.Rngs(seed))
    return {"model": model, "optimizer": nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)}


def test_a_resumed_bf16_run_scaled_by_a_weak_scalar_computes_the_same_bits(tmp_path):
    """Restored strongly typed, the scale would make the output float32: other bits, and the
    training step compiled again for the new type."""
    ref = _weak_objects(0)
    train_nnx(ref, 6)
    run = _weak_objects(0)
    train_nnx(run, 3)
    assert run["model"].temperature.get_value().weak_type and run["model"](X).dtype == jnp.bfloat16
    path = str(tmp_path / "ckpt")
    ckptcore.save_state(path, **run)
    assert ckptcore.load_state(path).extra["jax"]["weak"] == ["temperature"]
    fresh = _weak_objects(1)
    ckptcore.load_state(path, **fresh)
    t = fresh["model"].temperature.get_value()
    assert t.weak_type and t.dtype == jnp.float32
    out, want = fresh["model"](X), run["model"](X)
    assert out.dtype == jnp.bfloat16 and np.asarray(out).tobytes() == np.asarray(want).tobytes()
    train_nnx(fresh, 3)
    assert_same(_both(ref), _both(fresh), "resumed")
    out, want = fresh["model"](X), ref["model"](X)
    assert out.dtype == jnp.bfloat16 and np.asarray(out).tobytes() == np.asarray(want).tobytes()


def test_an_abstract_nnx_model_takes_the_weak_types_it_names(tmp_path):
    run = _weak_objects(0)
    train_nnx(run, 2)
    ckptcore.save_state(str(tmp_path / "ckpt"), model=run["model"])
    # ShapeDtypeStructs; temperature's says weak_type=True itself.
    abstract = nnx.eval_shape(lambda: _WeakNet(nnx.Rngs(0)))
    ckptcore.load_state(str(tmp_path / "ckpt"), model=abstract)
    assert abstract.temperature.get_value().weak_type
    assert np.asarray(abstract(X)).tobytes() == np.asarray(run["model"](X)).tobytes()


def _weak(value, shape=()):
    """A weakly typed array of ``shape`` filled with the Python scalar ``value`` (as
    ``jnp.full(shape, 0.7)`` makes), of JAX's default dtype of its kind."""
    return jax.lax.full_like(value, value, shape=shape)


@needs_8
@pytest.mark.parametrize("axes", ["auto", "explicit"])
def test_weak_leaves_come_back_weak_with_the_target_sharding(axes, tmp_path):
    devices = np.array(jax.devices()[:8]).reshape(4, 2)
    mesh = (Mesh(devices, ("a", "b")) if axes == "auto"
            else Mesh(devices, ("a", "b"), axis_types=(AxisType.Explicit,) * 2))
    src = {"scale": _weak(0.3), "wide": jax.device_put(_weak(0.7, (8,)), NamedSharding(mesh, P("a"))),
           "w": jnp.arange(4, dtype=jnp.bfloat16), "int": _weak(3)}
    assert [k for k, v in src.items() if v.weak_type] == ["scale", "wide", "int"]
    path = str(tmp_path / "c")
    ckptcore.save_state(path, model=ckptcore_jax.Ref(src))
    assert sorted(ckptcore.load_state(path).extra["jax"]["weak"]) == ["int", "scale", "wide"]

    def check(target, shardings):
        for k, v in target.value.items():
            assert v.weak_type == src[k].weak_type and v.dtype == src[k].dtype, k
            assert np.asarray(v).tobytes() == np.asarray(src[k]).tobytes(), k
            if k in shardings:
                assert v.sharding == shardings[k], k

    # Live targets on another layout, reading only their blocks: the live leaves say weak.
    cols = NamedSharding(mesh, P("b"))
    live = ckptcore_jax.Ref({"scale": _weak(0.0), "wide": jax.device_put(_weak(0.0, (8,)), cols),
                             "w": jnp.zeros(4, jnp.bfloat16), "int": _weak(0)})
    ckptcore.load_state(path, model=live, like=ckptcore_jax.template(live))
    check(live, {"wide": cols})
    # Abstract targets made by hand (weak_type=False): the names saved say weak.
    rows = NamedSharding(mesh, P("a"))
    abstract = ckptcore_jax.Ref({"scale": jax.ShapeDtypeStruct((), jnp.float32),
                                 "wide": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=rows),
                                 "w": jax.ShapeDtypeStruct((4,), jnp.bfloat16),
                                 "int": jax.ShapeDtypeStruct((), jnp.int32)})
    ckptcore.load_state(path, model=abstract)
    check(abstract, {"wide": rows})
    # A strongly typed live leaf stays strong: the target's own type decides.
    strong = {"scale": jnp.asarray(np.float32(0)), "wide": jnp.zeros(8), "w": jnp.zeros(4, jnp.bfloat16),
              "int": jnp.asarray(np.int32(0))}
    ckptcore_jax.restore(ckptcore.load_state(path), strong)
    assert not any(v.weak_type for v in strong.values())


def test_a_weak_optimizer_leaf_comes_back_weak_into_an_abstract_optax_state():
    p = {"w": jnp.ones(3)}
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    opt = tx.init(p)
    opt.hyperparams["learning_rate"] = _weak(0.25)   # as a Python float would set it
    state = ckptcore_jax.capture(ckptcore_jax.Ref(p), ckptcore_jax.Ref(opt))
    assert state.optimizer.extra["weak"] == ["hyperparams/learning_rate"]
    # Abstract leaves that do not say weak themselves: the optimizer's saved names do.
    target = ckptcore_jax.Ref(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tx.init(p)))
    ckptcore_jax.restore(state, ckptcore_jax.Ref(p), target)
    lr = target.value.hyperparams["learning_rate"]
    assert lr.weak_type and float(lr) == 0.25
    assert not target.value.count.weak_type

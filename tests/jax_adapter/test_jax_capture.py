"""ckptcore_jax's capture and restore beyond the conformance suite: Optax states of every shape
(Adam, AdamW, SGD momentum, schedules' counts, optax.chain, MultiSteps mid-window, a part of
the model frozen by multi_transform or masked) resumed bit for bit through a real checkpoint
directory, typed and raw keys, dtypes and devices kept, in-place pytrees, the errors, the names
not built yet, and the lazy import."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _jax_models import (X, Y, assert_same, make_step, model_arrays, nnx_arrays, nnx_objects,  # noqa: E402
                         params, train_nnx, tree_arrays)
from _support import subprocess_env  # noqa: E402
from flax import nnx  # noqa: E402

import ckptcore  # noqa: E402
import ckptcore_jax  # noqa: E402
from ckptcore.errors import RestoreError  # noqa: E402

_SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 0.05, 2, 10)
TXS = {
    "adam": optax.adam(0.01),
    "adamw": optax.adamw(0.01, weight_decay=0.1),
    "sgd_momentum": optax.sgd(0.05, momentum=0.9, nesterov=True),
    "chain_schedule": optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(),
                                  optax.scale_by_schedule(_SCHEDULE), optax.scale(-1.0)),
    "multisteps": optax.MultiSteps(optax.adam(0.01), every_k_schedule=4),  # 3 steps: mid-window
    "injected": optax.inject_hyperparams(optax.adamw)(learning_rate=0.01, weight_decay=0.05),
    # Part of the model frozen: Optax leaves a MaskedNode (no array) for each parameter a
    # transformation does not touch, which an nnx.Optimizer holds in a Variable of its own.
    "multi_transform": optax.multi_transform(
        {"train": optax.adam(0.01), "freeze": optax.set_to_zero()},
        lambda p: jax.tree.map(lambda x: "train" if x.ndim > 1 else "freeze", p)),
    "masked": optax.masked(optax.adam(0.01), lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
}


def _all_nnx(objects):
    return {**{f"model/{k}": v for k, v in nnx_arrays(objects["model"]).items()},
            **{f"opt/{k}": v for k, v in nnx_arrays(objects["optimizer"]).items()}}


@pytest.mark.parametrize("name", list(TXS))
def test_nnx_three_steps_saved_loaded_three_more_equal_six(name, tmp_path):
    tx = TXS[name]
    ref = nnx_objects(0, tx)
    train_nnx(ref, 6)
    run = nnx_objects(0, tx)
    train_nnx(run, 3)
    ckptcore.save_state(str(tmp_path / "ckpt"), **run)
    fresh = nnx_objects(1, tx)
    state = ckptcore.load_state(str(tmp_path / "ckpt"), **fresh)
    assert state.step == 3 == int(fresh["optimizer"].step.get_value())
    if name == "multisteps":  # the accumulation buffers of a window in progress are slots
        slots = {s for p in state.optimizer.slots.values() for s in p}
        assert "acc_grads" in slots and any(np.any(p["acc_grads"]) for p in state.optimizer.slots.values())
        assert int(state.optimizer.extra["leaves"]["mini_step"]) == 3
    train_nnx(fresh, 3)
    assert_same(_all_nnx(ref), _all_nnx(fresh), name)


@pytest.mark.parametrize("name", ["adam", "multisteps", "chain_schedule"])
def test_pytree_and_optax_state_resume_bitwise(name, tmp_path):
    tx = TXS[name]
    step = make_step(tx)

    def run(p, s, n):
        for _ in range(n):
            p, s = step(p, s, X, Y)
        return p, s

    p0 = params(0)
    ref_p, ref_s = run(p0, tx.init(p0), 6)
    p, s = run(p0, tx.init(p0), 3)
    ckptcore.save_state(str(tmp_path / "ckpt"), model=ckptcore_jax.Ref(p), optimizer=ckptcore_jax.Ref(s), step=3)
    p1 = params(1)
    mref, oref = ckptcore_jax.Ref(p1), ckptcore_jax.Ref(tx.init(p1))
    assert ckptcore.load_state(str(tmp_path / "ckpt"), model=mref, optimizer=oref).step == 3
    got_p, got_s = run(mref.value, oref.value, 3)
    assert_same(tree_arrays(ref_p), tree_arrays(got_p), "params")
    assert_same(tree_arrays(ref_s), tree_arrays(got_s), "optax state")
    assert mref.value["head"]["bias"].dtype == jnp.bfloat16


def test_nnx_optimizer_state_restores_into_a_bare_optax_state():
    objects = nnx_objects(0)
    train_nnx(objects, 2)
    state = ckptcore_jax.capture(**objects)
    assert set(state.optimizer.slots["lin/kernel"]) == {"0/mu", "0/nu"}
    assert "0/count" in state.optimizer.extra["leaves"] and state.optimizer.step == 2
    assert "bn/mean" in state.model and "drop/rngs/key" not in state.model
    assert set(state.rng["nnx"]) == {"drop/rngs/key", "drop/rngs/count"}
    assert state.params["lin/kernel"].layout == "io" and state.params["bn/mean"].kind == "batch_norm"
    p = nnx.state(objects["model"], nnx.Param)
    p = jax.tree.map(jnp.zeros_like, nnx.to_pure_dict(p))
    bare = ckptcore_jax.Ref(optax.adam(0.01).init(p))
    ckptcore_jax.restore(state, ckptcore_jax.Ref(p), bare, strict=False)
    assert np.array_equal(bare.value[0].mu["lin"]["kernel"], state.optimizer.slots["lin/kernel"]["0/mu"])
    assert int(bare.value[0].count) == 2


def test_keys_typed_and_raw_round_trip_through_disk(tmp_path):
    tree = {"w": jnp.arange(4.0), "key": jax.random.key(3), "keys": jax.random.split(jax.random.key(5), 3),
            "raw": jax.random.PRNGKey(4), "rbg": jax.random.key(1, impl="rbg")}
    state = ckptcore_jax.capture(ckptcore_jax.Ref(tree), rng=False)
    assert state.model["key"].dtype == np.uint32 and state.extra["jax"]["keys"]["key"] == "threefry2x32"
    assert state.extra["jax"]["keys"]["rbg"] == "rbg" and "raw" not in state.extra["jax"]["keys"]
    ckptcore.save_state(str(tmp_path / "k"), state)
    target = ckptcore_jax.Ref({"w": jnp.zeros(4), "key": jax.random.key(0), "keys": jax.random.split(jax.random.key(0), 3),
                               "raw": jax.random.PRNGKey(0), "rbg": jax.random.key(0, impl="rbg")})
    ckptcore.load_state(str(tmp_path / "k"), model=target)
    for k in ("key", "keys", "rbg"):
        assert jax.dtypes.issubdtype(target.value[k].dtype, jax.dtypes.prng_key)
        assert str(jax.random.key_impl(target.value[k])) == str(jax.random.key_impl(tree[k]))
        assert np.array_equal(jax.random.key_data(target.value[k]), jax.random.key_data(tree[k]))
    assert target.value["raw"].dtype == jnp.uint32 and np.array_equal(target.value["raw"], tree["raw"])
    assert np.array_equal(jax.random.normal(target.value["key"], (3,)), jax.random.normal(tree["key"], (3,)))
    wrong = ckptcore_jax.Ref({**target.value, "key": jax.random.key(0, impl="rbg")})
    with pytest.raises(RestoreError, match="key: .*threefry2x32 key.*rbg key"):
        ckptcore_jax.restore(state, wrong)


def test_restore_keeps_dtype_and_device():
    dev = jax.devices()[3]
    src = {"a": jnp.arange(6, dtype=jnp.bfloat16), "b": jnp.ones((2, 2), jnp.int8), "c": jnp.float16(2.5)}
    state = ckptcore_jax.capture(ckptcore_jax.Ref(src))
    target = {k: jax.device_put(jnp.zeros_like(v), dev) for k, v in src.items()}
    ckptcore_jax.restore(state, target)  # a dict: its items are replaced in place
    for k, v in target.items():
        assert v.dtype == src[k].dtype and v.devices() == {dev}, k
        assert np.asarray(v).tobytes() == np.asarray(src[k]).tobytes(), k


def test_mismatches_name_the_leaf():
    state = ckptcore_jax.capture(ckptcore_jax.Ref({"a": jnp.zeros(3)}))
    with pytest.raises(RestoreError, match="a: the checkpoint holds shape \\[3\\], the target has \\[4\\]"):
        ckptcore_jax.restore(state, {"a": jnp.zeros(4)})
    with pytest.raises(RestoreError, match="a: the checkpoint holds float32, the target is int32"):
        ckptcore_jax.restore(state, {"a": jnp.zeros(3, jnp.int32)})
    report = ckptcore_jax.restore(state, {"a": jnp.zeros(3), "b": jnp.ones(2)}, strict=False)
    assert report.missing == ("b",)


def test_a_tuple_pytree_needs_a_ref():
    state = ckptcore_jax.capture(ckptcore_jax.Ref((jnp.zeros(2),)))
    with pytest.raises(TypeError, match="ckptcore_jax.Ref"):
        ckptcore_jax.restore(state, [(jnp.zeros(2),)])
    with pytest.raises(TypeError, match="nnx.Module, a dict"):
        ckptcore_jax.capture(object())


def test_rng_streams_follow_rng_flag():
    objects = nnx_objects(0)
    train_nnx(objects, 1)
    state = ckptcore_jax.capture(**objects)
    other = nnx_objects(1)
    before = nnx_arrays(other["model"])["drop/rngs/key"]
    ckptcore_jax.restore(state, **other, rng=False)
    assert np.array_equal(nnx_arrays(other["model"])["drop/rngs/key"], before)
    assert_same(model_arrays(objects["model"]), model_arrays(other["model"]), "model")
    ckptcore_jax.restore(state, **other)
    assert np.array_equal(nnx_arrays(other["model"])["drop/rngs/key"],
                          nnx_arrays(objects["model"])["drop/rngs/key"])


def test_the_adapter_hands_out_its_parts():
    assert ckptcore_jax.ADAPTER.dialect.name == "jax"
    assert [f.name for f in ckptcore_jax.ADAPTER.formats] == ["orbax"]
    assert isinstance(ckptcore_jax.process_group(), ckptcore.SingleProcessGroup)
    assert issubclass(ckptcore_jax.NotYetImplementedError, NotImplementedError)


def test_a_state_of_another_framework_that_cannot_be_placed_is_refused_clearly():
    state = ckptcore.TrainingState(model={"w": np.zeros(2, np.float32)}, framework="torch")
    with pytest.raises(ckptcore.MigrationError, match="cannot convert this torch state to jax"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckptcore_jax.restore(state, {"w": jnp.zeros(2)})


def test_the_demo_trains():
    program = ckptcore_jax.ADAPTER.demo(seed=0, features=4, classes=3)
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    y = np.arange(8) % 3
    before = np.array(program.objects["model"].out.kernel.get_value())
    program.train_step(x, y)
    assert not np.array_equal(before, program.objects["model"].out.kernel.get_value())


def test_importing_the_adapter_imports_no_jax():
    code = ("import sys, ckptcore, ckptcore_jax; "
            "from ckptcore.registry import adapter_for; adapter_for({'w': [1.0]}) if False else None; "
            "ckptcore_jax.ADAPTER.handles({'w': 1.0}); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'optax', 'orbax')]; "
            "print(bad); assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=subprocess_env(), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]

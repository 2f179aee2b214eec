"""What the adapter caches between saves of the same model (DLPack views of its tensors, its
ParamInfo) must never outlive what it describes: a parameter replaced, added, reshaped or
re-typed, a layer reconfigured, a buffer swapped by Paddle's own ``set_state_dict``, an optimizer
that gains accumulators.  Each case saves or captures again and compares with Paddle's own view of
the tensors, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

paddle = pytest.importorskip("paddle", reason="paddlepaddle is not installed")

import ckptcore  # noqa: E402
import ckptcore_paddle as cp  # noqa: E402
from _models import Tiny, snapshot, train_step  # noqa: E402
from ckptcore_paddle import _tensors  # noqa: E402

X = np.random.RandomState(0).randn(6, 4).astype("float32")


@pytest.fixture(autouse=True)
def _seeded():
    paddle.seed(0)


def _trained(model=None, steps: int = 1):
    model = model if model is not None else Tiny()
    opt = paddle.optimizer.Adam(0.01, parameters=model.parameters())
    for _ in range(steps):
        train_step(model, opt, None, X)
    return model, opt


def _same(captured: dict[str, np.ndarray], model) -> None:
    """The captured model section is Paddle's state_dict, bit for bit (and nothing else)."""
    expected = {k: v.numpy() for k, v in model.state_dict().items()}
    assert captured.keys() == expected.keys(), sorted(set(captured) ^ set(expected))
    for k, v in expected.items():
        assert captured[k].shape == v.shape and captured[k].dtype == v.dtype, k
        assert np.array_equal(captured[k].view(np.uint8), v.view(np.uint8)), k


def _same_slots(state, model, opt) -> None:
    snap = snapshot(model, opt)
    names = {p.name: k for k, p in model.state_dict().items()}
    for acc, per_param in opt._accumulators.items():
        for pname in per_param:
            got = state.optimizer.slots[names[pname]][acc]
            assert np.array_equal(got, snap[f"slot/{names[pname]}/{acc}"]), (pname, acc)


@pytest.mark.parametrize("copy", [False, True])
def test_repeated_captures_follow_training(copy) -> None:
    net, opt = _trained()
    first = cp.capture(net, opt, rng=False, copy=True)
    train_step(net, opt, None, X)
    second = cp.capture(net, opt, rng=False, copy=copy)
    _same(second.model, net)
    _same_slots(second, net, opt)
    assert not np.array_equal(first.model["fc1.weight"], second.model["fc1.weight"])
    assert second.optimizer.step == first.optimizer.step + 1


def test_replaced_parameter_is_captured_not_the_old_one() -> None:
    net, opt = _trained()
    cp.capture(net, opt, rng=False, copy=False)  # fills the caches
    old = net.fc2.weight
    new = paddle.create_parameter(old.shape, old.dtype,
                                  default_initializer=paddle.nn.initializer.Constant(7.0))
    net.fc2.weight = new
    state = cp.capture(net, rng=False, copy=False)
    _same(state.model, net)
    assert np.all(state.model["fc2.weight"] == 7.0)
    assert state.extra["paddle"]["param_names"]["fc2.weight"] == new.name


def test_added_layer_is_captured_and_described() -> None:
    net, _ = _trained(Tiny(extra=True))
    net.extra = None  # a model whose layer appears later: first saved without it
    state = cp.capture(net, rng=False)
    assert "extra.weight" not in state.model and "extra.weight" not in state.params
    net.extra = paddle.nn.Linear(8, 8)
    state = cp.capture(net, rng=False, copy=False)
    _same(state.model, net)
    assert state.params["extra.weight"].kind == "dense" and state.params["extra.weight"].attrs["in_features"] == 8
    assert state.params["fc2.weight"].index == 3  # every index after the new layer moved


def test_reshaped_layer_is_described_and_captured_afresh() -> None:
    net, _ = _trained()
    cp.capture(net, rng=False, copy=False)
    net.fc2 = paddle.nn.Linear(8, 5)  # same names, new shapes
    state = cp.capture(net, rng=False, copy=False)
    _same(state.model, net)
    assert state.params["fc2.weight"].attrs["out_features"] == 5
    assert state.model["fc2.bias"].shape == (5,)


def test_buffer_reshaped_in_place() -> None:
    net, _ = _trained()
    before = cp.capture(net, rng=False, copy=False)
    assert before.model["bn._mean"].shape == (8,)
    net.bn._mean.reshape_([2, 4])  # same buffer, another shape
    state = cp.capture(net, rng=False, copy=False)
    _same(state.model, net)
    assert state.model["bn._mean"].shape == (2, 4)


def test_layer_facts_changed_without_new_tensors() -> None:
    net, _ = _trained()
    assert cp.capture(net, rng=False).params["bn._mean"].attrs["epsilon"] == pytest.approx(1e-5)
    net.bn._epsilon = 1e-3
    assert cp.capture(net, rng=False).params["bn._mean"].attrs["epsilon"] == pytest.approx(1e-3)


def test_swapped_buffers_are_followed(tmp_path) -> None:
    """A tensor that gets another buffer (``_share_buffer_to``, as sharing-based loaders do) while
    staying the same object: a cached view of the old buffer would save stale values, and a
    restore would write into memory the tensor no longer uses."""
    net, opt = _trained()
    cp.capture(net, opt, rng=False, copy=False)  # fills the caches
    weight, moment = net.fc1.weight, opt._accumulators["moment1"][net.fc1.weight.name]
    ptrs = weight.data_ptr(), moment.data_ptr()
    paddle.full(weight.shape, 3.0)._share_buffer_to(weight)
    paddle.full(moment.shape, 5.0)._share_buffer_to(moment)
    assert (weight.data_ptr(), moment.data_ptr()) != ptrs  # the premise: new buffers, same objects
    state = cp.capture(net, opt, rng=False, copy=False)
    _same(state.model, net)
    _same_slots(state, net, opt)
    assert np.all(state.model["fc1.weight"] == 3.0) and np.all(state.optimizer.slots["fc1.weight"]["moment1"] == 5.0)
    # And the other way: a restore writes into the buffers the tensors hold now.
    src, src_opt = _trained(Tiny(), steps=3)
    url = str(tmp_path / "ck")
    ckptcore.save_state(url, model=src, optimizer=src_opt)
    ckptcore.load_state(url, model=net, optimizer=opt)  # fills the caches with the current buffers
    paddle.zeros(weight.shape)._share_buffer_to(weight)
    paddle.zeros(moment.shape)._share_buffer_to(moment)
    ckptcore.load_state(url, model=net, optimizer=opt)
    _same({k: v.numpy() for k, v in src.state_dict().items()}, net)
    _same_slots(cp.capture(src, src_opt, rng=False), net, opt)


def test_after_paddle_set_state_dict(tmp_path) -> None:
    """Paddle's own loader between two saves and two restores of the same objects."""
    with paddle.utils.unique_name.guard():  # the same runtime names, which paddle.load needs
        net, opt = _trained()
    with paddle.utils.unique_name.guard():
        other, other_opt = _trained(Tiny(), steps=3)
    cp.capture(net, opt, rng=False, copy=False)
    paddle.save(other.state_dict(), str(tmp_path / "m.pdparams"))
    paddle.save(other_opt.state_dict(), str(tmp_path / "m.pdopt"))
    net.set_state_dict(paddle.load(str(tmp_path / "m.pdparams")))
    opt.set_state_dict(paddle.load(str(tmp_path / "m.pdopt")))
    state = cp.capture(net, opt, rng=False, copy=False)  # accumulators parked, not yet applied
    _same(state.model, net)
    train_step(net, opt, None, X)
    train_step(other, other_opt, None, X)
    state = cp.capture(net, opt, rng=False, copy=False)
    _same(state.model, net)
    _same_slots(state, net, opt)
    _same(state.model, other)


def test_optimizer_that_gains_accumulators(tmp_path) -> None:
    net = Tiny()
    opt = paddle.optimizer.Adam(0.01, parameters=net.parameters())
    empty = cp.capture(net, opt, rng=False, copy=False)
    assert empty.optimizer.slots == {}
    train_step(net, opt, None, X)
    state = cp.capture(net, opt, rng=False, copy=False)
    assert set(state.optimizer.slots["fc1.weight"]) >= {"moment1", "moment2", "beta1_pow_acc"}
    _same_slots(state, net, opt)
    # A second model's optimizer restored into from a fresh start, then saved: its new
    # accumulators (created by the restore) are the ones captured.
    fresh = Tiny()
    fresh_opt = paddle.optimizer.Adam(0.01, parameters=fresh.parameters())
    cp.capture(fresh, fresh_opt, rng=False, copy=False)
    assert cp.restore(state, fresh, fresh_opt).ok
    again = cp.capture(fresh, fresh_opt, rng=False, copy=False)
    _same_slots(again, fresh, fresh_opt)
    for name, slots in state.optimizer.slots.items():
        for slot, value in slots.items():
            assert np.array_equal(again.optimizer.slots[name][slot], value), (name, slot)


def test_restore_writes_in_place_and_repeats(tmp_path) -> None:
    """A restore through the cached views sets the live buffers (no new allocation), and a
    second restore into the same objects after more training still lands."""
    src, src_opt = _trained()
    url = str(tmp_path / "ck")
    ckptcore.save_state(url, model=src, optimizer=src_opt)
    net, opt = _trained(Tiny(), steps=2)
    ptrs = {k: v.data_ptr() for k, v in net.state_dict().items()}
    for _ in range(2):
        ckptcore.load_state(url, model=net, optimizer=opt)
        _same({k: v.numpy() for k, v in src.state_dict().items()}, net)
        _same_slots(cp.capture(src, src_opt, rng=False), net, opt)
        assert {k: v.data_ptr() for k, v in net.state_dict().items()} == ptrs
        train_step(net, opt, None, X)


def test_views_are_dropped_for_tensors_no_longer_given() -> None:
    net, _ = _trained()
    tensors = list(net.state_dict().values())
    assert all(v is not None for v in _tensors.views(net, tensors))
    assert len(_tensors._VIEWS[net]) == len(tensors)
    _tensors.views(net, tensors[:2])
    assert len(_tensors._VIEWS[net]) == 2  # the others' buffers are no longer held


def test_tensors_without_a_view_use_the_slow_path() -> None:
    """bfloat16 has no DLPack dtype in numpy: captured and restored through Paddle's own copy."""
    net = Tiny()
    net.fc2.to(dtype="bfloat16")
    assert _tensors.views(net, [net.fc2.weight]) == [None]
    state = cp.capture(net, rng=False, copy=False)
    assert str(state.model["fc2.weight"].dtype) == "bfloat16"
    other = Tiny()
    other.fc2.to(dtype="bfloat16")
    assert cp.restore(state, other).ok
    assert np.array_equal(other.fc2.weight.numpy(), net.fc2.weight.numpy())


def test_grouped_copies_split_across_two_threads(monkeypatch) -> None:
    """A restore's copies go in groups, a large group halved between two threads (an array
    across the middle cut in two, verified whole by the first half): every byte lands, every
    value is verified once, and a strided target is never cut (reshape would copy it)."""
    monkeypatch.setattr(_tensors, "_SPLIT", 1)
    rng = np.random.RandomState(1)

    class Plan:
        def __init__(self):
            self.puts = []

        def assign_many(self, items, put, verifies=False):
            assert verifies
            self.puts.append(put)

    for trial in range(60):
        shapes = [tuple(rng.randint(1, 40, size=rng.randint(0, 3))) for _ in range(rng.randint(1, 6))]
        srcs = [np.asarray(rng.randn(*s)).astype(rng.choice(["float32", "float64", "int8"])) for s in shapes]
        dsts = [np.zeros_like(s) for s in srcs]
        if trial % 3 == 0 and dsts[-1].ndim == 2:  # a transposed (strided) target
            dsts[-1] = np.zeros(dsts[-1].shape[::-1], dsts[-1].dtype).T
        pairs = list(zip(dsts, srcs))
        nbytes = sum(d.nbytes for d in dsts)
        first, second = _tensors._halves(pairs, nbytes)
        assert sum(d.nbytes for d, _, _ in first + second) == nbytes
        assert sorted(id(w) for _, _, w in first + second if w is not None) == sorted(map(id, srcs))
        assert all(d.flags.c_contiguous or any(d is x for x in dsts) for d, _, _ in first + second)
        plan = Plan()
        copies = _tensors.Copies(plan, helper=True)
        for k, (d, s) in enumerate(pairs):
            copies.add(f"t{k}", None, d, s)
        copies.flush()
        try:
            for put in plan.puts:
                put()
        finally:
            copies.close()
        assert all(np.array_equal(d, s) for d, s in pairs), trial


def _corrupt_tensor(url: str, name: str) -> None:
    """Flip one bit of tensor ``name``'s bytes in its shard."""
    from ckptcore._manifest import MANIFEST_NAME, Manifest

    with open(f"{url}/{MANIFEST_NAME}", "rb") as f:
        m = Manifest.from_bytes(f.read())
    t = next(t for t in m.tensors if t.name == name)
    with open(f"{url}/{m.shards[t.shard].path}", "r+b") as f:
        f.seek(t.offset)
        byte = f.read(1)
        f.seek(t.offset)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("group", [64, 1 << 30])
def test_restore_plans_copies_in_groups(tmp_path, monkeypatch, group) -> None:
    """Copies in groups of a few bytes (many groups, each halved) or all in one: a streamed
    restore lands every tensor and slot bit for bit, in the live buffers; with one tensor
    damaged, the restore raises before writing its group or any later one."""
    monkeypatch.setattr(_tensors, "GROUP", group)
    monkeypatch.setattr(_tensors, "_SPLIT", 32)
    src, src_opt = _trained()
    url = str(tmp_path / "ck")
    ckptcore.save_state(url, model=src, optimizer=src_opt)
    net, opt = _trained(Tiny(), steps=2)
    ptrs = {k: v.data_ptr() for k, v in net.state_dict().items()}
    ckptcore.load_state(url, model=net, optimizer=opt)
    _same({k: v.numpy() for k, v in src.state_dict().items()}, net)
    _same_slots(cp.capture(src, src_opt, rng=False), net, opt)
    assert {k: v.data_ptr() for k, v in net.state_dict().items()} == ptrs

    names = list(net.state_dict())
    bad = names[len(names) // 2]
    _corrupt_tensor(url, f"model/{bad}")
    net, opt = _trained(Tiny(), steps=2)
    before = {k: v.numpy().copy() for k, v in net.state_dict().items()}
    with pytest.raises(ckptcore.errors.CorruptCheckpointError) as exc:
        ckptcore.load_state(url, model=net, optimizer=opt)
    assert exc.value.tensor == f"model/{bad}"
    after = {k: v.numpy() for k, v in net.state_dict().items()}
    assert np.array_equal(after[bad], before[bad])  # the damaged tensor is never written
    for k in names[names.index(bad):]:  # nor is anything after it
        assert np.array_equal(after[k], before[k]), k


@pytest.mark.parametrize("ahead", [0, 1 << 40])
def test_gradients_scanned_in_a_helper_or_in_place(monkeypatch, ahead) -> None:
    """Gradients in flight are captured bit for bit and cleared ones listed as zero, whether a
    helper thread looked at them (any size from 0 on) or the capturing thread did."""
    from ckptcore_paddle import _capture

    monkeypatch.setattr(_capture, "_SCAN_AHEAD", ahead)
    net, opt = _trained()
    train_step(net, opt, None, X)
    opt.clear_grad()  # every gradient zero
    net(paddle.to_tensor(X)).mean().backward()  # then most in flight again
    net.fc2.bias.clear_gradient(True)  # and one cleared in place
    state = cp.capture(net, opt, rng=False)
    buffers = state.accumulation.buffers
    assert "fc2.bias" not in buffers and "fc2.bias" in state.extra["paddle"]["zero_grads"]
    for name, p in {n: p for n, p in net.named_parameters()}.items():
        if name in buffers:
            assert np.array_equal(buffers[name], p.grad.numpy()), name
    assert buffers, "some gradients are in flight"


def test_a_restore_leaves_no_shard_mapped(tmp_path) -> None:
    """Once load_state(model=, optimizer=) returns (and its state is dropped), the shard it
    mapped is unmapped at once: nothing of the restore (its plan, its copy groups) holds the
    loaded arrays in a reference cycle, so the page cache under them can be dropped."""
    import gc

    src, src_opt = _trained()
    url = str(tmp_path / "ck")
    ckptcore.save_state(url, model=src, optimizer=src_opt)
    net, opt = _trained(Tiny(), steps=2)
    gc.collect()
    gc.disable()
    try:
        ckptcore.load_state(url, model=net, optimizer=opt)
        with open("/proc/self/maps") as f:
            assert not [line for line in f if str(tmp_path) in line]
    finally:
        gc.enable()


def test_a_damaged_tensor_keeps_later_viewless_tensors_untouched(tmp_path) -> None:
    """A tensor with no writable view (bfloat16 here) is put on its own, not in a group: it
    still waits for the group before it, so a damaged earlier tensor leaves it as it was."""
    import paddle

    class M(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.a = self.create_parameter([256, 256], dtype="float32")
            self.b = self.create_parameter([256, 256], dtype="bfloat16")

    m = M()
    with paddle.no_grad():
        m.a.set_value(paddle.full([256, 256], 1.0, "float32"))
        m.b.set_value(paddle.full([256, 256], 1.0, "bfloat16"))
    url = str(tmp_path / "ck")
    ckptcore.save_state(url, model=m)
    _corrupt_tensor(url, "model/a")
    with paddle.no_grad():
        m.a.set_value(paddle.full([256, 256], 5.0, "float32"))
        m.b.set_value(paddle.full([256, 256], 5.0, "bfloat16"))
    with pytest.raises(ckptcore.errors.CorruptCheckpointError):
        ckptcore.load_state(url, model=m)
    assert float(m.a.numpy()[0, 0]) == 5.0
    assert float(m.b.astype("float32").numpy()[0, 0]) == 5.0  # the later tensor is not written

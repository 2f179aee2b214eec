"""ckptcore_torch: the parts of a model's state_dict() that are not one plain tensor each.

Modules' extra state (``get_extra_state``/``set_extra_state``), entries a custom
``_save_to_state_dict`` adds, tied weights' optimizer slots and gradients whatever order the
submodules are registered in, gradients of parameters a ``strict=False`` restore drops, and the
dtypes at the edge (``float8_e8m0fnu`` stored, ``complex32`` refused).  Through real directories
where the save and load matter.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ckptcore  # noqa: E402
import ckptcore_torch  # noqa: E402
from ckptcore.errors import CaptureError, RestoreError  # noqa: E402
from _torch_models import assert_same, optimizer_arrays  # noqa: E402


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# ----------------------------------------------------------------------------- extra state


class _Scaled(torch.nn.Linear):
    """An fp8-style layer: its amax history is extra state, a tensor made on each call."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self.amax = torch.zeros(3, dtype=torch.bfloat16)
        self.received: list = []

    def get_extra_state(self):
        return self.amax.clone()

    def set_extra_state(self, state):
        self.received.append(state)
        self.amax = state


class _Serialized(torch.nn.Module):
    """Extra state as a variable-length byte tensor (how Transformer Engine serialises its own)."""

    def __init__(self, payload: bytes = b"") -> None:
        super().__init__()
        self.payload = payload

    def get_extra_state(self):
        return torch.frombuffer(bytearray(self.payload), dtype=torch.uint8) if self.payload else \
            torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        self.payload = state.numpy().tobytes()


class _Counted(torch.nn.Linear):
    """Extra state as plain data: a dict of numbers, strings, bytes, a tuple and a tensor."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self.extra: object = {"calls": 0}

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state):
        self.extra = state


def test_tensor_extra_state_goes_back_through_set_extra_state(tmp_path):
    """A tensor extra state reaches the module's set_extra_state bit for bit (not a copy into the
    throwaway get_extra_state made), whatever its length, in order with the weights."""
    torch.manual_seed(0)
    src = torch.nn.Sequential(_Scaled(), _Serialized(b"\x00\x01fp8 meta\xff"))
    src[0].amax = torch.tensor([1.5, -3.0, 448.0], dtype=torch.bfloat16)
    url = str(tmp_path / "ckpt")
    ckptcore.save_state(url, model=src)
    assert sorted(ckptcore.load_state(url).model) == ["0._extra_state", "0.bias", "0.weight", "1._extra_state"]
    torch.manual_seed(1)
    dst = torch.nn.Sequential(_Scaled(), _Serialized())
    report = ckptcore.load_state(url, model=dst)
    assert report.model["0.weight"].tobytes() == _bits(src[0].weight)
    assert len(dst[0].received) == 1 and dst[0].amax.dtype == torch.bfloat16
    assert _bits(dst[0].amax) == _bits(src[0].amax)
    assert dst[1].payload == b"\x00\x01fp8 meta\xff"  # 11 bytes into a module whose own were 0
    assert _bits(dst[0].weight) == _bits(src[0].weight)
    # In memory too (capture/restore without a directory).
    again = torch.nn.Sequential(_Scaled(), _Serialized())
    ckptcore_torch.restore(ckptcore_torch.capture(src), again)
    assert _bits(again[0].amax) == _bits(src[0].amax) and again[1].payload == src[1].payload


def test_plain_extra_state_round_trips(tmp_path):
    """A non-tensor extra state is saved as plain data (no pickle) and set back as it was: tuples
    stay tuples, tensors come back as tensors of their dtype, bit for bit."""
    src = _Counted()
    hist = torch.tensor([0.1, 2.0 ** -20, float("nan")], dtype=torch.bfloat16)
    src.extra = {"calls": 42, "name": "amax", "raw": b"\x00\xff", "window": (1.5, None, [2, 3]),
                 "hist": hist, 7: np.float32(0.25)}
    url = str(tmp_path / "ckpt")
    ckptcore.save_state(url, model=src)
    dst = _Counted()
    assert ckptcore.load_state(url, model=dst) is not None
    got = dst.extra
    assert set(got) == set(src.extra)
    assert got["calls"] == 42 and got["name"] == "amax" and got["raw"] == b"\x00\xff"
    assert got["window"] == (1.5, None, [2, 3]) and type(got["window"]) is tuple
    assert isinstance(got["hist"], torch.Tensor) and got["hist"].dtype == torch.bfloat16
    assert _bits(got["hist"]) == _bits(hist)
    assert type(got[7]) is np.float32 and got[7] == np.float32(0.25)
    assert _bits(dst.weight) == _bits(src.weight)

    # A checkpoint without it: reported missing, never passed over silently.
    plain = torch.nn.Linear(2, 2)
    ckptcore.save_state(str(tmp_path / "plain"), model=plain)
    with pytest.raises(RestoreError, match="_extra_state"):
        ckptcore.load_state(str(tmp_path / "plain"), model=_Counted())
    report = ckptcore_torch.restore(ckptcore_torch.capture(plain), _Counted(), strict=False)
    assert report.missing == ("_extra_state",)
    # keys=["model"] leaves out the extra section that holds it: the error says how to load it.
    with pytest.raises(RestoreError, match=r"keys=\[..., 'extra'\]"):
        ckptcore.load_state(url, model=_Counted(), keys=["model"])
    dst = _Counted()
    ckptcore.load_state(url, model=dst, keys=["model", "extra"])
    assert dst.extra["calls"] == 42
    # Saved, and the target has none: unexpected.
    with pytest.raises(RestoreError, match="_extra_state"):
        ckptcore.load_state(url, model=torch.nn.Linear(2, 2))


def test_extra_state_with_no_plain_form_is_a_capture_error():
    m = torch.nn.Sequential(torch.nn.ReLU(), _Counted())
    m[1].extra = io.BytesIO(b"pickled")
    with pytest.raises(CaptureError, match=r"1\._extra_state \(the extra state of a _Counted\) is a "
                                           r"_io\.BytesIO.*get_extra_state\(\) return a tensor, or plain data"):
        ckptcore_torch.capture(m)
    m[1].extra = {"ok": 1, "bad": {3, 4}}
    with pytest.raises(CaptureError, match=r"\['bad'\] is a builtins\.set"):
        ckptcore_torch.capture(m)
    m[1].extra = {"arr": np.zeros(2)}
    with pytest.raises(CaptureError, match="NumPy array.*return a torch tensor"):
        ckptcore_torch.capture(m)


class _Custom(torch.nn.Linear):
    """A custom _save_to_state_dict adding a tensor that is no parameter or buffer of the module."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self.scale = torch.ones(2)  # a plain attribute, not registered

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "scale"] = self.scale * 1


class _Registered(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(2, 2)
        self.register_buffer("scale", torch.full((2,), 3.0))


def test_state_dict_entry_that_is_no_parameter_or_buffer_is_refused():
    """Such an entry could only be copied into a throwaway on restore: refused at capture, a
    RestoreError on a strict restore, reported by a strict=False one."""
    with pytest.raises(CaptureError, match=r"scale \(a torch\.float32 tensor\), which is not a registered "
                                           r"parameter, buffer or extra state.*register_buffer"):
        ckptcore_torch.capture(torch.nn.Sequential(_Custom()))
    state = ckptcore_torch.capture(torch.nn.Sequential(_Registered()))
    target = torch.nn.Sequential(_Custom())
    with pytest.raises(RestoreError, match=r"0\.scale .*not restored"):
        ckptcore_torch.restore(state, target)
    report = ckptcore_torch.restore(state, target, strict=False)
    assert report.unexpected == ("0.scale",) and report.missing == ()
    assert _bits(target[0].weight) == state.model["0.weight"].tobytes()


# ----------------------------------------------------------------------------- gradients, strict=False


def test_strict_false_drops_a_parameter_with_its_gradient(tmp_path):
    """A saved parameter the target lacks is reported with its gradient (the usual loop saves
    with .grad set), not refused; strict=True still refuses it."""
    torch.manual_seed(0)
    pre = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 10))
    opt = torch.optim.SGD(pre.parameters(), lr=0.1)
    opt.zero_grad()
    pre(torch.randn(2, 3)).sum().backward()
    opt.step()
    url = str(tmp_path / "ckpt")
    ckptcore.save_state(url, model=pre)
    fine = torch.nn.Sequential(torch.nn.Linear(3, 4))
    with pytest.raises(RestoreError, match="accumulation/1.weight"):
        ckptcore.load_state(url, model=fine)
    ckptcore.load_state(url, model=fine, strict=False)
    report = ckptcore_torch.restore(ckptcore.load_state(url), fine, strict=False)
    assert set(report.unexpected) == {"1.weight", "1.bias", "accumulation/1.weight", "accumulation/1.bias"}
    assert report.missing == ()
    assert _bits(fine[0].weight) == _bits(pre[0].weight)
    assert _bits(fine[0].weight.grad) == _bits(pre[0].weight.grad)


# ----------------------------------------------------------------------------- tied weights


class _EmbFirst(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 4)
        self.head = torch.nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(self.emb(tokens))


class _HeadFirst(_EmbFirst):
    """The same model, its head registered first: state_dict() names the tied tensor head.weight."""

    def __init__(self) -> None:
        torch.nn.Module.__init__(self)
        self.head = torch.nn.Linear(4, 5, bias=False)
        self.emb = torch.nn.Embedding(5, 4)
        self.head.weight = self.emb.weight


class _Untied(_EmbFirst):
    def __init__(self) -> None:
        torch.nn.Module.__init__(self)
        self.emb = torch.nn.Embedding(5, 4)
        self.head = torch.nn.Linear(4, 5, bias=False)


_TOKENS = torch.tensor([[1, 2, 4], [0, 3, 3]])
_TARGET = torch.tensor([[2, 4, 0], [3, 3, 1]])


def _loss(m):
    return torch.nn.functional.cross_entropy(m(_TOKENS).reshape(-1, 5), _TARGET.reshape(-1))


def _step(m, opt):
    _loss(m).backward()
    opt.step()
    opt.zero_grad()


def test_tied_weights_resume_bitwise_whatever_the_registration_order(tmp_path):
    """Adam's slots and the gradient in flight of a tied weight are keyed by whichever name came
    first at save; a model registering its submodules the other way round resumes bit for bit
    (strict, empty report), and so does one registering them the same way."""
    torch.manual_seed(0)
    a = _EmbFirst()
    opt = torch.optim.Adam(a.parameters(), lr=0.01)
    for _ in range(3):
        _step(a, opt)
    _loss(a).backward()  # half an accumulation window: the gradient is in flight
    url = str(tmp_path / "ckpt")
    ckptcore.save_state(url, model=a, optimizer=opt)
    saved = ckptcore.load_state(url)
    assert list(saved.optimizer.slots) == ["emb.weight"] and list(saved.accumulation.buffers) == ["emb.weight"]
    grad, slots = _bits(a.emb.weight.grad), optimizer_arrays(opt)
    expected = _continue(a, opt)  # the uninterrupted run
    for cls in (_HeadFirst, _EmbFirst):
        torch.manual_seed(1)
        b = cls()
        assert next(iter(b.state_dict())) == ("head.weight" if cls is _HeadFirst else "emb.weight")
        opt_b = torch.optim.Adam(b.parameters(), lr=0.01)
        _step(b, opt_b)  # its own, different state, which the restore must replace
        loaded = ckptcore.load_state(url, model=b, optimizer=opt_b)
        assert loaded.step == saved.step
        assert _bits(b.emb.weight.grad) == grad, cls.__name__
        assert_same(slots, optimizer_arrays(opt_b), f"{cls.__name__} restored")
        assert _continue(b, opt_b) == expected, cls.__name__
        assert_same(optimizer_arrays(opt), optimizer_arrays(opt_b), f"{cls.__name__} resumed")


def _continue(m, opt):
    """Finish the accumulation window, then two more steps: the weights' bytes after each."""
    _loss(m).backward()
    opt.step()
    opt.zero_grad()
    out = [_bits(m.emb.weight)]
    for _ in range(2):
        _step(m, opt)
        out.append(_bits(m.emb.weight))
    return out


def test_tied_checkpoint_into_untied_model_gives_each_copy_the_tied_state():
    """The untied head takes the tied tensor's values (as before), and now its Adam slots and
    gradient too, instead of none at all with an empty report."""
    torch.manual_seed(0)
    a = _EmbFirst()
    opt = torch.optim.Adam(a.parameters(), lr=0.01)
    for _ in range(2):
        _step(a, opt)
    _loss(a).backward()
    state = ckptcore_torch.capture(a, opt)
    u = _Untied()
    opt_u = torch.optim.Adam(u.parameters(), lr=0.01)
    report = ckptcore_torch.restore(state, u, opt_u)
    assert report.ok
    tied = opt.state[a.emb.weight]
    for p in (u.emb.weight, u.head.weight):
        assert _bits(p) == _bits(a.emb.weight) and _bits(p.grad) == _bits(a.emb.weight.grad)
        assert set(opt_u.state[p]) == set(tied)
        for k, v in tied.items():
            assert _bits(opt_u.state[p][k]) == _bits(v), k
    assert opt_u.state[u.emb.weight]["exp_avg"].data_ptr() != opt_u.state[u.head.weight]["exp_avg"].data_ptr()


class _WithFc(_EmbFirst):
    def __init__(self, head_first: bool = False) -> None:
        torch.nn.Module.__init__(self)
        if head_first:
            self.head = torch.nn.Linear(4, 5, bias=False)
        self.emb = torch.nn.Embedding(5, 4)
        if not head_first:
            self.head = torch.nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight
        self.fc = torch.nn.Linear(5, 5)

    def forward(self, tokens):
        return self.fc(self.head(self.emb(tokens)))


def test_tied_weight_in_another_param_group_is_refused():
    """Param groups are compared by the names the state holds: the tied weight moved to the
    group of other hyperparameters is refused (it would silently take them), whatever name the
    target gives it."""
    torch.manual_seed(0)
    a = _WithFc()
    opt = torch.optim.Adam([{"params": [a.emb.weight, a.fc.weight]},
                            {"params": [a.fc.bias], "lr": 0.5}], lr=0.01)
    _step(a, opt)
    state = ckptcore_torch.capture(a, opt)
    b = _WithFc(head_first=True)
    moved = torch.optim.Adam([{"params": [b.fc.weight]}, {"params": [b.head.weight, b.fc.bias], "lr": 0.5}],
                             lr=0.01)
    with pytest.raises(RestoreError, match="parameter group 0 holds"):
        ckptcore_torch.restore(state, b, moved)
    kept = torch.optim.Adam([{"params": [b.head.weight, b.fc.weight]}, {"params": [b.fc.bias], "lr": 0.5}],
                            lr=0.01)
    assert ckptcore_torch.restore(state, b, kept).ok
    assert_same(optimizer_arrays(opt), optimizer_arrays(kept), "the same groups")


# ----------------------------------------------------------------------------- dtypes at the edge


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="this torch has no float8_e8m0fnu")
def test_float8_e8m0fnu_round_trips_bitwise(tmp_path):
    """Every one of its 256 bit patterns (0xff is its NaN), through a real directory."""
    m = torch.nn.Module()
    m.register_buffer("scales", torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu).reshape(16, 16))
    url = str(tmp_path / "ckpt")
    ckptcore.save_state(url, model=m)
    assert ckptcore.load_state(url).model["scales"].dtype.name == "float8_e8m0fnu"
    dst = torch.nn.Module()
    dst.register_buffer("scales", torch.zeros(16, 16, dtype=torch.float8_e8m0fnu))
    ckptcore.load_state(url, model=dst)
    assert dst.scales.dtype == torch.float8_e8m0fnu and _bits(dst.scales) == _bits(m.scales)


def test_dtype_with_no_numpy_form_is_a_capture_error():
    m = torch.nn.Module()
    with warnings.catch_warnings():  # "ComplexHalf support is experimental" (once per process)
        warnings.simplefilter("ignore", UserWarning)
        m.register_buffer("z", torch.zeros(2, dtype=torch.complex32))
    with pytest.raises(CaptureError, match=r"z: a torch\.complex32 tensor has no NumPy form .*complex64"):
        ckptcore_torch.capture(m)

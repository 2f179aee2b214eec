""".pdparams/.pdopt interop: the restricted unpickler (in this process, without Paddle), real
``paddle.save`` files, export accepted by ``paddle.load``, and import hygiene."""

from __future__ import annotations

import collections
import os
import pickle
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest

import ckptcore
import ckptcore_paddle
from ckptcore.adapter import FileFormat
from ckptcore.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptcore_paddle import export_paddle_files, import_paddle_files
from ckptcore_paddle._files import FORMATS, load_paddle_pickle
from ckptcore_paddle._optimizer import split_accumulator_key, step_from_pow

CASES = ["mlp_adam_warmup", "cnn_momentum_poly", "zoo_rmsprop", "mlp_adagrad_named",
         "mlp_adamw_second_cawr", "mlp_momentum_protocol2"]


class _Reduce:
    """Pickles as ``func(*args)`` (with an optional BUILD ``state``): how malicious pickles are made."""

    def __init__(self, func, args, state=None):
        self.func, self.args, self.state = func, args, state

    def __reduce__(self):
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


def _stack_global(module: str, name: str, arg: str) -> bytes:
    """Protocol 4: ``module.name(arg)``, where a dotted ``name`` makes the unpickler walk attributes."""
    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s)]) + s.encode()
    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(arg) + b"\x85R."


def _malicious(canary: Path) -> dict[str, bytes]:
    touch = f"touch {canary}"
    code = f"__import__('os').system({touch!r})"
    arr = np.zeros(2, "float32")
    pickles = {
        "os.system": _Reduce(os.system, (touch,)),
        "subprocess.Popen": _Reduce(subprocess.Popen, (["touch", str(canary)],)),
        "eval with code": _Reduce(eval, (code,)),
        "eval with code and a namespace": _Reduce(eval, (code, {"data": arr})),
        "eval of a name that is not an array": _Reduce(eval, ("os", {"os": 1})),
        "exec": _Reduce(exec, (code,)),
        "getattr chain": _Reduce(getattr, (_Reduce(__import__, ("os",)), "system")),
        "__import__": _Reduce(__import__, ("os",)),
        "object array": np.array([1, "x"], dtype=object),
        "dtype claiming to hold objects": _Reduce(np.dtype, ("f8", False, True),
                                                  (3, "<", None, None, None, -1, -1, 63)),
        "structured dtype": np.zeros(2, dtype=[("a", "f4"), ("b", "i4")]),
        "ndarray called directly": _Reduce(np.ndarray, ((3,), "f4")),
        "OrderedDict given attributes": _Reduce(collections.OrderedDict, (), {"x": 1}),
        "nested in a state dict": {"fc.weight": arr, "fc.bias": _Reduce(os.system, (touch,))},
    }
    out = {name: pickle.dumps(obj, protocol=4) for name, obj in pickles.items()}
    out["posix.system via REDUCE (protocol 0)"] = b"cposix\nsystem\n(V" + touch.encode() + b"\ntR."
    out["dotted global os.path.os.system"] = _stack_global("os", "path.os.system", touch)
    out["dotted global on an allowed module"] = _stack_global("numpy", "ndarray.tofile", str(canary))

    class _PersistentPickler(pickle.Pickler):
        def persistent_id(self, obj):
            return "payload" if isinstance(obj, str) else None

    buf = __import__("io").BytesIO()
    _PersistentPickler(buf, protocol=4).dump({"a": "b"})
    out["persistent id"] = buf.getvalue()
    return out


@pytest.mark.parametrize("name", sorted(_malicious(Path("x"))))
def test_malicious_pickles_are_refused_and_run_nothing(tmp_path, name):
    canary = tmp_path / "canary"
    path = tmp_path / "evil.pdparams"
    path.write_bytes(_malicious(canary)[name])
    with pytest.raises(UnsafeCheckpointError) as info:
        import_paddle_files(path)
    assert str(path) in str(info.value)
    assert not canary.exists()


def test_refusal_names_the_global(tmp_path):
    path = tmp_path / "evil.pdopt"
    path.write_bytes(_malicious(tmp_path / "canary")["subprocess.Popen"])
    with pytest.raises(UnsafeCheckpointError, match="subprocess.Popen"):
        load_paddle_pickle(path)


def test_truncated_file_is_corrupt_not_unsafe(tmp_path):
    path = tmp_path / "cut.pdparams"
    path.write_bytes(pickle.dumps({"w": np.arange(100.0)}, protocol=4)[:-40])
    with pytest.raises(CorruptCheckpointError):
        import_paddle_files(path)


@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4])  # paddle.save writes 2 to 4
def test_plain_numeric_pickles_of_every_protocol_load(tmp_path, protocol):
    obj = {"a": np.arange(12, dtype=">f4").reshape(3, 4), "b": np.asfortranarray(np.ones((2, 3), "int64")),
           "c": np.array(True), "d": np.zeros((0, 3), "float16"), "e": np.complex64(1 + 2j),
           "LR_Scheduler": {"last_epoch": 3, "last_lr": np.float64(0.25)}}
    path = tmp_path / "x.pdopt"
    path.write_bytes(pickle.dumps(obj, protocol=protocol))
    got, expected = load_paddle_pickle(path), pickle.loads(path.read_bytes())  # our own, trusted bytes
    for k in "abcd":  # (numpy's unpickling makes big-endian arrays native)
        assert got[k].dtype == expected[k].dtype and np.array_equal(got[k], obj[k]), k
        assert got[k].flags.c_contiguous == expected[k].flags.c_contiguous, k
    assert got["e"] == obj["e"] and got["LR_Scheduler"] == {"last_epoch": 3, "last_lr": 0.25}


def test_numpy1_module_name_is_accepted(tmp_path):
    raw = pickle.dumps({"w": np.arange(4, dtype="float32")}, protocol=2)
    assert b"numpy._core.multiarray" in raw
    path = tmp_path / "old.pdparams"
    path.write_bytes(raw.replace(b"numpy._core.multiarray", b"numpy.core.multiarray"))
    assert np.array_equal(import_paddle_files(path).model["w"], np.arange(4, dtype="float32"))


def test_big_arrays_split_by_protocol_2_saves_are_joined(tmp_path):
    w = np.arange(10, dtype="float32").reshape(2, 5)
    flat = w.reshape(-1)
    saved = {"fc.weight@@.0": flat[:6], "fc.weight@@.1": flat[6:], "fc.bias": np.ones(5, "float32"),
             "UnpackBigParamInfor@@": {"fc.weight": {"OriginShape": (2, 5),
                                                     "slices": ["fc.weight@@.0", "fc.weight@@.1"]}}}
    path = tmp_path / "big.pdparams"
    path.write_bytes(pickle.dumps(saved, protocol=2))
    state = import_paddle_files(path)
    assert sorted(state.model) == ["fc.bias", "fc.weight"] and np.array_equal(state.model["fc.weight"], w)


def test_step_from_pow_is_exact_where_a_logarithm_is_not():
    for beta, steps in ((0.999, [0, 1, 7, 966, 3000, 38538, 87000]), (0.9, [0, 5, 800])):
        seq = np.multiply.accumulate(np.full(max(steps) + 1, np.float32(beta), dtype=np.float32))
        for t in steps:
            assert step_from_pow(float(seq[t]), beta) == t, (beta, t)
    stuck = np.multiply.accumulate(np.full(1300, np.float32(0.9), dtype=np.float32))
    assert stuck[1000] == stuck[1200] and step_from_pow(float(stuck[1200]), 0.9) is None


def test_accumulator_key_parsing():
    assert split_accumulator_key("moment1_0") == ("moment1", None, False)
    assert split_accumulator_key("moment2_max_12") == ("moment2_max", None, False)
    assert split_accumulator_key("myopt_moment_1") == ("moment", "myopt", False)
    assert split_accumulator_key("fp32_master_0_velocity_0") == ("velocity", None, True)
    assert split_accumulator_key("beta2_pow_acc_3") == ("beta2_pow_acc", None, False)


# ----------------------------------------------------------------------------- with real Paddle files


@pytest.fixture(scope="module")
def pdfiles():
    """The Paddle half of these tests (skips them, with the reason, where Paddle is not installed)."""
    pytest.importorskip("paddle", reason="paddlepaddle is not installed")
    import _pdfiles
    return _pdfiles


@pytest.fixture(scope="module")
def files(tmp_path_factory, pdfiles):
    d = tmp_path_factory.mktemp("pdfiles")
    return d, pdfiles.save_files(str(d))


@pytest.fixture(scope="module")
def exported(files, pdfiles):
    d, _ = files
    state = pickle.loads((d / "clean_state.pkl").read_bytes())
    paths = export_paddle_files(state, d / "export")
    cawr = import_paddle_files(d / "mlp_adamw_second_cawr.pdparams", d / "mlp_adamw_second_cawr.pdopt")
    return state, paths, pdfiles.load_exported(str(d), cawr)


def _ref(d: Path, case: str) -> dict[str, np.ndarray]:
    with np.load(d / f"{case}.ref.npz") as z:
        return {k: z[k] for k in z.files}


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("case", CASES)
def test_real_paddle_files_import_exactly(files, case):
    d, ref = files
    state = import_paddle_files(d / f"{case}.pdparams", d / f"{case}.pdopt")
    arrays = _ref(d, case)
    aliases = state.extra["paddle"].get("aliases", {})
    loaded = {k[len("pdparams/"):]: v for k, v in arrays.items() if k.startswith("pdparams/")}
    assert set(state.model) | set(aliases) == set(loaded)
    for key, value in loaded.items():
        assert _same(state.model[aliases.get(key, key)], value), key
    assert state.extra["paddle"]["param_names"] == {k: ref[case]["names"][k] for k in state.model}
    live = {tuple(k.split("/")[1:]): v for k, v in arrays.items() if k.startswith("slot/")}
    got = {(p, s): v for p, slots in state.optimizer.slots.items() for s, v in slots.items()}
    prefix = "myopt_" if case == "mlp_adagrad_named" else ""
    assert {(aliases.get(p, p), acc[len(prefix):]) for p, acc in live} == set(got)
    for (p, acc), value in live.items():
        assert _same(got[(aliases.get(p, p), acc[len(prefix):])], value), (p, acc)
    if ref[case]["lr_scheduler"] is not None:
        assert state.schedule.state == ref[case]["lr_scheduler"]
        assert "scheduler" not in state.extra["paddle"]
        assert state.schedule.step == ref[case]["lr_scheduler"]["last_epoch"]
    if case == "mlp_adam_warmup":
        assert (state.optimizer.kind, state.optimizer.step) == ("adam", 5)


def test_static_mode_and_nested_saves_load_without_evaluating(files):
    d, _ = files
    dense = load_paddle_pickle(d / "dense_tensor.pd")
    assert _same(dense["w"], np.arange(6, dtype="float32").reshape(2, 3))
    nested = load_paddle_pickle(d / "nested.pd")
    name, value = nested["nested"]["w"]
    assert isinstance(name, str) and _same(value, dense["w"]) and nested["n"] == 3


@pytest.mark.parametrize("case", ["mlp_adam_warmup", "cnn_momentum_poly", "zoo_rmsprop", "mlp_adagrad_named"])
def test_import_then_export_reproduces_paddle_save(files, tmp_path, case):
    d, _ = files
    export_paddle_files(import_paddle_files(d / f"{case}.pdparams", d / f"{case}.pdopt"), tmp_path / case)
    for ext in ("pdparams", "pdopt"):
        ours, theirs = load_paddle_pickle(tmp_path / f"{case}.{ext}"), load_paddle_pickle(d / f"{case}.{ext}")
        assert ours.keys() == theirs.keys(), ext
        for k, v in theirs.items():
            assert _same(ours[k], v) if isinstance(v, np.ndarray) else ours[k] == v, (ext, k)


def test_export_is_accepted_by_paddle_load_and_set_state_dict(files, exported):
    d, _ = files
    state, paths, out = exported
    assert paths == (str(d / "export.pdparams"), str(d / "export.pdopt"))
    assert out["set_state_dict"] == [[], []]
    for k, v in out["loaded"].items():
        assert np.array_equal(np.asarray(v, dtype=state.model[k].dtype), state.model[k]), k
    with np.load(d / "clean_next.npz") as a, np.load(d / "exported_next.npz") as b:
        assert a.files == b.files
        for k in a.files:
            assert _same(a[k], b[k]), k  # the next step from Paddle's own loader is bitwise the original's


def test_restore_recovers_what_paddles_own_cawr_state_lacks(files, exported):
    _, ref = files
    out = exported[2]
    assert out["cawr_report"] == []
    assert out["cawr_lrs"] == ref["mlp_adamw_second_cawr"]["next_lrs"]


def test_files_work_where_paddle_cannot_be_imported(files, tmp_path, run_python):
    d, _ = files
    script = textwrap.dedent(f"""
        import sys
        sys.modules["paddle"] = None  # any "import paddle" now fails
        import ckptcore_paddle
        s = ckptcore_paddle.import_paddle_files({str(d / 'cnn_momentum_poly.pdparams')!r},
                                                {str(d / 'cnn_momentum_poly.pdopt')!r})
        assert s.optimizer.slots["fc.weight"]["velocity"].shape == (16, 10)
        print(ckptcore_paddle.export_paddle_files(s, {str(tmp_path / 'out')!r}))
        assert sys.modules["paddle"] is None
    """)
    run_python("-c", script)
    assert (tmp_path / "out.pdparams").exists() and (tmp_path / "out.pdopt").exists()


def test_importing_the_adapter_does_not_import_paddle(run_python):
    script = textwrap.dedent("""
        import sys
        import ckptcore_paddle
        assert ckptcore_paddle.ADAPTER.name == "paddle"
        assert not ckptcore_paddle.ADAPTER.handles(object())
        formats = ckptcore_paddle.ADAPTER.formats
        assert [f.name for f in formats] == ["pdparams", "paddle-dcp"]
        loaded = sorted(m for m in sys.modules if m == "paddle" or m.startswith("paddle."))
        assert not loaded, loaded
    """)
    run_python("-c", script)


# ----------------------------------------------------------------------------- ckpt import / export


def test_the_pdparams_format_reads_and_writes_through_the_cli_contract(files, tmp_path):
    d, _ = files
    fmt, dcp = FORMATS
    assert dcp.name == "paddle-dcp" and dcp.write is None and not dcp.detect(str(d))
    assert isinstance(fmt, FileFormat) and fmt is ckptcore_paddle.ADAPTER.formats[0]
    assert (fmt.name, fmt.framework, set(fmt.options)) == ("pdparams", "paddle", {"pdopt"})
    assert fmt.detect(str(d / "cnn_momentum_poly.pdparams")) and not fmt.detect(str(d / "x.pdopt"))
    src = str(d / "cnn_momentum_poly.pdparams")
    beside = fmt.read(src)  # the .pdopt next to it is found
    given = fmt.read(src, pdopt=str(d / "cnn_momentum_poly.pdopt"))
    direct = import_paddle_files(src, d / "cnn_momentum_poly.pdopt")
    for state in (beside, given):
        assert state.optimizer.slots.keys() == direct.optimizer.slots.keys()
        assert all(np.array_equal(state.model[k], v) for k, v in direct.model.items())
    lone = tmp_path / "lone.pdparams"
    lone.write_bytes((d / "cnn_momentum_poly.pdparams").read_bytes())
    assert fmt.read(str(lone)).optimizer is None
    wrote = fmt.write(direct, str(tmp_path / "out.pdparams"), pdopt=str(tmp_path / "elsewhere.pdopt"))
    assert wrote == f"{tmp_path / 'out.pdparams'}, {tmp_path / 'elsewhere.pdopt'}"
    again = fmt.read(str(tmp_path / "out.pdparams"), pdopt=str(tmp_path / "elsewhere.pdopt"))
    assert all(np.array_equal(again.optimizer.slots[p][s], v)
               for p, slots in direct.optimizer.slots.items() for s, v in slots.items())
    with pytest.raises(TypeError, match="compress"):
        fmt.read(src, compress=True)
    with pytest.raises(TypeError, match="compress"):
        fmt.write(direct, str(tmp_path / "x"), compress=True)


def test_export_creates_the_target_folder(tmp_path):
    """Like paddle.save, export_paddle_files writes into a folder that does not exist yet."""
    state = ckptcore.TrainingState(model={"w": np.arange(3, dtype="float32")}, framework="paddle")
    written = export_paddle_files(state, tmp_path / "new" / "dir" / "m")
    assert Path(written[0]).is_file() and Path(written[0]).parent == tmp_path / "new" / "dir"
    assert np.array_equal(import_paddle_files(written[0]).model["w"], state.model["w"])

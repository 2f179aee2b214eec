"""Framework-neutral :class:`~ckptcore.state.ParamInfo` for each entry of a PyTorch module's state.

Modules are recognised by class name (the first built-in name in the class's MRO, so a subclass
of ``nn.Linear`` is a dense layer).  Kinds and roles are the shared vocabulary of
:mod:`ckptcore.vocab`, so migration can match a torch model with another framework's by order,
kind and shape.  Layouts name the axes of torch's arrays: ``oi`` for Linear, ``oik`` / ``oihw`` /
``oidhw`` for convolutions (a depthwise one is a grouped ``oihw``: ``(in*M, 1, h, w)``),
``iok`` / ``iohw`` / ``iodhw`` for transposed ones, ``o`` for biases, ``vd`` for embeddings.
Recurrent weights are ``(gates*hidden, in)`` (``attrs["axes"] == "oi"``) and their layout is the
gate order: torch's LSTM ``i, f, g, o`` is the vocabulary's ``ifco`` (``g`` is the cell
candidate), its GRU ``r, z, n`` is ``rzc`` (with the reset gate applied after the recurrent
matmul: ``attrs["reset_after"]``).  ``MultiheadAttention``'s packed ``in_proj_weight``
``[3e, e]`` is its ``qkv_kernel`` of layout ``oi`` (query, key and value stacked on ``o``,
``attrs["projection"] == "qkv"``), ``in_proj_bias`` its ``qkv_bias``; its ``out_proj`` belongs to
it (``output_kernel``/``output_bias``, ``projection == "attention_output"``).
BatchNorm's ``attrs["momentum"]`` is the neutral one, ``1 - torch's`` (moving = moving·momentum +
batch·(1-momentum); torch's own is ``torch_momentum``), and ``variance_update == "unbiased"``.

A module family the vocabulary has no word for keeps its class name in snake case as its kind.

Structure (what feeds what): the model runs once, in eval mode and with the RNGs untouched, on a
small zero input shaped for its first parameter-owning module (a Linear's ``in_features``, a
convolution's channels at a few spatial sizes, token ids for an Embedding, a sequence for a
recurrent layer); forward hooks note the order modules run and which parameter-owning modules'
outputs reach each one through the autograd graph (``grad_fn.next_functions``), whatever
functional ops lie between.  Each ParamInfo's ``attrs["order"]`` and ``attrs["inputs"]`` hold
that; when no probe input runs the model, neither is recorded (structure unknown).
"""

from __future__ import annotations

import logging
import math
import re
import weakref
from typing import Any, Mapping

import torch

from ckptcore.state import ParamInfo
from ckptcore.vocab import Kind, Role, plain

from ._tensors import canonical_name, wrapper_components

_log = logging.getLogger("ckptcore")

_CONV = {"Conv1d": (Kind.CONV1D, "oik"), "Conv2d": (Kind.CONV2D, "oihw"), "Conv3d": (Kind.CONV3D, "oidhw"),
         "ConvTranspose1d": (Kind.CONV1D_TRANSPOSE, "iok"), "ConvTranspose2d": (Kind.CONV2D_TRANSPOSE, "iohw"),
         "ConvTranspose3d": (Kind.CONV3D_TRANSPOSE, "iodhw")}
_BATCH_NORM = {"BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm"}
_INSTANCE_NORM = {"InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d"}
_NORM_ROLES = {"weight": Role.GAMMA, "bias": Role.BETA, "running_mean": Role.MOVING_MEAN,
               "running_var": Role.MOVING_VARIANCE}
_RNN = {"LSTM": (Kind.LSTM, "ifco"), "GRU": (Kind.GRU, "rzc"), "RNN": (Kind.SIMPLE_RNN, None),
        "LSTMCell": (Kind.LSTM, "ifco"), "GRUCell": (Kind.GRU, "rzc"), "RNNCell": (Kind.SIMPLE_RNN, None)}
_RNN_ROLES = {"weight_ih": Role.KERNEL, "weight_hh": Role.RECURRENT_KERNEL, "bias_ih": Role.BIAS,
              "bias_hh": Role.RECURRENT_BIAS, "weight_hr": "projection_kernel"}
_RNN_NAME = re.compile(r"^(weight_ih|weight_hh|bias_ih|bias_hh|weight_hr)(?:_l(\d+))?(_reverse)?$")
# --- migration (H6): MultiheadAttention roles are "<projection>_kernel"/"<projection>_bias", the
# packed in_proj "qkv_kernel"/"qkv_bias" (query, key, value stacked on the output axis), as
# ckptcore.migrate.layouts reads attention layers; bias_k/bias_v have no counterpart elsewhere.
_MHA_PROJ = {"in_proj_weight": ("qkv_kernel", "oi", "qkv"), "in_proj_bias": ("qkv_bias", "o", "qkv"),
             "q_proj_weight": ("query_kernel", "oi", "query"), "k_proj_weight": ("key_kernel", "oi", "key"),
             "v_proj_weight": ("value_kernel", "oi", "value"), "bias_k": ("bias_k", None, "key"),
             "bias_v": ("bias_v", None, "value"), "out_proj.weight": ("output_kernel", "oi", "attention_output"),
             "out_proj.bias": ("output_bias", "o", "attention_output")}
# --- end migration (H6)
_KNOWN = {"Linear", "Bilinear", "Embedding", "EmbeddingBag", "LayerNorm", "GroupNorm", "PReLU",
          "MultiheadAttention", "RMSNorm", *_CONV, *_BATCH_NORM, *_INSTANCE_NORM, *_RNN}
_NORMS = (Kind.BATCH_NORM, Kind.LAYER_NORM, Kind.GROUP_NORM, Kind.INSTANCE_NORM)
# Modules that keep a feature map's channel count: a Linear after them still reads that map.
_PASS_THROUGH = {"MaxPool2d", "AvgPool2d", "AdaptiveAvgPool2d", "AdaptiveMaxPool2d", "ReLU", "ReLU6",
                 "LeakyReLU", "Sigmoid", "Tanh", "GELU", "SiLU", "Hardswish", "ELU", "Dropout",
                 "Dropout2d", "Flatten", "Identity"}


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def _family(module: Any) -> str:
    """The first built-in class name in ``module``'s MRO (its own name for a custom module)."""
    for cls in type(module).__mro__:
        if cls.__name__ in _KNOWN and cls.__module__.startswith("torch."):
            return cls.__name__
    return type(module).__name__


def describe_params(model: Any, tensors: Mapping[str, Any], aliases: Mapping[str, str] = ()
                    ) -> dict[str, ParamInfo]:
    """ParamInfo for every entry of ``tensors`` (canonical names), walking ``model`` in module order.

    ``index`` counts only modules that own at least one described entry.  The structure trace is
    cached on the model (one forward pass per set of modules, not one per save).
    """
    components = wrapper_components(model)
    out: dict[str, ParamInfo] = {}
    owners: dict[int, str] = {}  # id(module) -> path, for modules owning described entries
    index = 0
    spatial: int | None = None  # channels of the last 2-D feature map
    claimed: set[int] = set()
    for path, mod in model.named_modules():
        if id(mod) in claimed:
            continue
        cls = _family(mod)
        own = _own_entries(mod)
        if cls == "MultiheadAttention" and isinstance(getattr(mod, "out_proj", None), torch.nn.Module):
            claimed.add(id(mod.out_proj))
            own += [f"out_proj.{n}" for n in _own_entries(mod.out_proj)]
        names = [(n, canonical_name(f"{path}.{n}" if path else n, components)) for n in own]
        names = [(n, full) for n, full in names if full in tensors]
        if names:
            kind, layout, attrs = _layer_facts(mod, cls, spatial)
            layer = canonical_name(path, components)
            owners[id(mod)] = layer
            for short, full in names:
                out[full] = _param(index, layer, kind, layout, attrs, short)
            index += 1
        spatial = _next_spatial(mod, cls, spatial)
    structure = _structure(model, owners)
    if structure is not None:
        for info in out.values():
            order, inputs = structure.get(info.layer, (-1, []))
            info.attrs["order"], info.attrs["inputs"] = order, list(inputs)
    return out


def _own_entries(mod: Any) -> list[str]:
    own = [n for n, _ in mod.named_parameters(recurse=False)]
    skip = getattr(mod, "_non_persistent_buffers_set", set())
    return own + [n for n, _ in mod.named_buffers(recurse=False) if n not in skip]


def _layer_facts(mod: Any, cls: str, spatial: int | None) -> tuple[str, str | None, dict]:
    if cls == "Linear":
        attrs: dict[str, Any] = {"in_features": int(mod.in_features), "out_features": int(mod.out_features)}
        if spatial is not None:
            attrs.update(_flatten_facts(int(mod.in_features), spatial))
        return Kind.DENSE, "oi", attrs
    if cls in _CONV:
        kind, layout = _CONV[cls]
        cin, cout, groups = int(mod.in_channels), int(mod.out_channels), int(mod.groups)
        attrs = {"in_channels": cin, "out_channels": cout, "groups": groups,
                 "kernel_size": list(mod.kernel_size), "stride": list(mod.stride),
                 "padding": plain(mod.padding), "dilation": list(mod.dilation), "data_format": "channels_first"}
        if kind == Kind.CONV2D and groups == cin and groups > 1 and cout % cin == 0:
            kind, attrs["depth_multiplier"] = Kind.DEPTHWISE_CONV2D, cout // cin
        return kind, layout, attrs
    if cls in _BATCH_NORM or cls in _INSTANCE_NORM:
        kind = Kind.BATCH_NORM if cls in _BATCH_NORM else Kind.INSTANCE_NORM
        # --- migration (H6): ParamInfo's momentum is the neutral one (moving = moving*momentum +
        # batch*(1-momentum)); torch's is the weight of the batch (running = (1-m)*running + m*batch),
        # kept as torch_momentum (None: a cumulative average, no momentum at all).  torch updates
        # running_var with the unbiased (n-1) batch variance.
        m = mod.momentum
        attrs = {"momentum": None if m is None else 1.0 - float(m), "torch_momentum": plain(m),
                 "variance_update": "unbiased"}
        # --- end migration (H6)
        return kind, None, {**attrs, "epsilon": float(mod.eps),
                            "affine": bool(mod.affine), "track_running_stats": bool(mod.track_running_stats),
                            "num_features": int(mod.num_features), "data_format": "channels_first"}
    if cls in ("LayerNorm", "RMSNorm"):
        kind = Kind.LAYER_NORM if cls == "LayerNorm" else "rms_norm"
        return kind, None, {"epsilon": plain(mod.eps), "normalized_shape": list(mod.normalized_shape)}
    if cls == "GroupNorm":
        return Kind.GROUP_NORM, None, {"epsilon": float(mod.eps), "num_groups": int(mod.num_groups),
                                       "num_channels": int(mod.num_channels)}
    if cls in ("Embedding", "EmbeddingBag"):
        return Kind.EMBEDDING, None, {"num_embeddings": int(mod.num_embeddings),
                                      "embedding_dim": int(mod.embedding_dim),
                                      "padding_idx": None if mod.padding_idx is None else int(mod.padding_idx)}
    if cls in _RNN:
        kind, gates = _RNN[cls]
        attrs = {"axes": "oi", "gate_order": gates, "input_size": int(mod.input_size),
                 "hidden_size": int(mod.hidden_size), "bias": bool(mod.bias)}
        if not cls.endswith("Cell"):
            attrs.update(num_layers=int(mod.num_layers), num_directions=2 if mod.bidirectional else 1,
                         batch_first=bool(mod.batch_first), proj_size=int(getattr(mod, "proj_size", 0)))
        if kind == Kind.GRU:
            attrs["reset_after"] = True
        if kind == Kind.SIMPLE_RNN:
            attrs["activation"] = str(getattr(mod, "nonlinearity", "tanh"))
        return kind, gates, attrs
    if cls == "MultiheadAttention":
        e, h = int(mod.embed_dim), int(mod.num_heads)
        return Kind.MULTI_HEAD_ATTENTION, None, {"embed_dim": e, "num_heads": h, "head_dim": e // h,
                                                 "kdim": int(mod.kdim), "vdim": int(mod.vdim),
                                                 "batch_first": bool(mod.batch_first)}
    if cls == "PReLU":
        return Kind.PRELU, None, {"num_parameters": int(mod.num_parameters)}
    return _snake(cls), None, {"class": type(mod).__name__}


def _param(index: int, path: str, kind: str, layout: str | None, attrs: dict, short: str) -> ParamInfo:
    attrs = plain(attrs)  # a fresh dict of plain values
    if kind in _NORMS:
        if short == "num_batches_tracked":   # migration (H6): torch's own counter, nothing else needs it
            attrs["optional"] = True
        return ParamInfo(index, path, kind, _NORM_ROLES.get(short, short), None, attrs)
    if kind == Kind.EMBEDDING:
        return ParamInfo(index, path, kind, Role.EMBEDDINGS if short == "weight" else short,
                         "vd" if short == "weight" else None, attrs)
    if kind in (Kind.LSTM, Kind.GRU, Kind.SIMPLE_RNN):
        m = _RNN_NAME.match(short)
        if m:
            attrs["layer_index"] = int(m.group(2) or 0)
            attrs["direction"] = "reverse" if m.group(3) else "forward"
            return ParamInfo(index, path, kind, _RNN_ROLES[m.group(1)], layout, attrs)
        return ParamInfo(index, path, kind, short, layout, attrs)
    if kind == Kind.MULTI_HEAD_ATTENTION and short in _MHA_PROJ:
        role, axes, projection = _MHA_PROJ[short]
        attrs["projection"] = projection
        if projection == "qkv":
            attrs["packed"] = ["query", "key", "value"]
        return ParamInfo(index, path, kind, role, axes, attrs)
    if kind == Kind.PRELU and short == "weight":
        return ParamInfo(index, path, kind, Role.ALPHA, None, attrs)
    if short == "weight":
        return ParamInfo(index, path, kind, Role.KERNEL, layout, attrs)
    if short == "bias":
        return ParamInfo(index, path, kind, Role.BIAS, "o", attrs)
    return ParamInfo(index, path, kind, short, None, attrs)


def _flatten_facts(in_features: int, channels: int) -> dict[str, Any]:
    """What a Linear right after a 2-D feature map (conv, pooling, flatten) reads, when it can be
    told: as in the Paddle adapter, ``input_shape`` is the map in flattening order (``[C, H, W]``:
    torch flattens channels first), recorded when ``in_features`` is ``channels * s * s``;
    ``inferred`` says it was deduced."""
    if channels <= 0 or in_features % channels:
        return {}
    hw = in_features // channels
    side = math.isqrt(hw)
    facts: dict[str, Any] = {"input_order": "channels_first", "input_channels": channels, "inferred": True}
    if side * side == hw:
        facts["input_shape"] = [channels, side, side]
    return facts


def _next_spatial(mod: Any, cls: str, spatial: int | None) -> int | None:
    if cls in ("Conv2d", "ConvTranspose2d"):
        return int(mod.out_channels)
    if cls in _BATCH_NORM or cls in _INSTANCE_NORM or cls == "GroupNorm" or cls in _PASS_THROUGH:
        return spatial
    if not _own_entries(mod):  # containers and parameter-free modules change nothing we know
        return spatial
    return None


# ----------------------------------------------------------------------------- structure

_STRUCTURE: weakref.WeakKeyDictionary[Any, tuple] = weakref.WeakKeyDictionary()


def _structure(model: Any, owners: dict[int, str]) -> dict[str, tuple[int, list[str]]] | None:
    """``path -> (position in run order, paths of the parameter-owning modules feeding it)``, or
    None; cached on the model per set of modules (the trace is a forward pass, saves are many)."""
    key = tuple(sorted(owners.items()))
    try:
        cached = _STRUCTURE.get(model)
    except TypeError:
        cached = None
    if cached is not None and cached[0] == key:
        return cached[1]
    result = None
    # A compiled block inside would compile on the probe (seconds, and a C compiler): not traced.
    # Nor a model with DTensor parameters (FSDP2, tensor parallel): its forward is a collective,
    # which a capture on some ranks only (or at different times) would hang in.
    skip = any(type(m).__name__ == "OptimizedModule" for m in model.modules()) or any(
        type(p).__name__ == "DTensor" for p in model.parameters())
    for probe in [] if skip else _probe_inputs(model, owners):
        result = _trace(model, owners, probe)
        if result is not None:
            break
    if result is None:
        _log.info("ckptcore: no probe input runs %s; its layer structure is recorded as unknown",
                  type(model).__name__)
    try:
        _STRUCTURE[model] = (key, result)
    except TypeError:
        pass
    return result


def _probe_inputs(model: Any, owners: dict[int, str]) -> list[tuple[str, list[int]]]:
    """(dtype, shape) of zero inputs worth a forward pass: the input each parameter-owning module
    would take if it came first, in definition order, deduplicated, at most 12."""
    out: list[tuple[str, list[int]]] = []
    for _, mod in model.named_modules():
        if id(mod) not in owners:
            continue
        cls = _family(mod)
        if cls == "Linear":   # a feature vector, or (migration, H6) a sequence of them
            shapes = [("float", [2, int(mod.in_features)]), ("float", [2, 5, int(mod.in_features)])]
        elif cls in ("Conv1d", "Conv2d", "Conv3d"):
            nd, c = int(cls[4]), int(mod.in_channels)
            shapes = [("float", [2, c] + [s] * nd) for s in ((32, 28, 64, 224) if nd == 2 else (32, 16, 64))]
        elif cls in ("Embedding", "EmbeddingBag"):
            shapes = [("long", [2, 8])]
        elif cls in ("LSTM", "GRU", "RNN"):
            shapes = [("float", [2, 5, int(mod.input_size)])]
        else:
            shapes = []
        out.extend(x for x in shapes if x not in out)
        if len(out) >= 12:  # a bound on failed forward passes (each fails fast, at a shape check)
            break
    return out


def _tensors(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return [value] if isinstance(value, torch.Tensor) else []


def _probe_tensor(model: Any, probe: tuple[str, list[int]]) -> torch.Tensor:
    """A zero input on the model's device (float: of its parameters' dtype, requiring grad, so
    every op on the way gets a grad node even with frozen weights)."""
    dtype, shape = probe
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    if dtype == "long":
        return torch.zeros(shape, dtype=torch.long, device=device)
    fdtype = first.dtype if first is not None and first.is_floating_point() else torch.float32
    return torch.zeros(shape, dtype=fdtype, device=device, requires_grad=True)


def _trace(model: Any, owners: dict[int, str], probe: tuple[str, list[int]]
           ) -> dict[str, tuple[int, list[str]]] | None:
    produced: dict[Any, str] = {}  # grad node of a module's output -> that module's path
    found: dict[str, tuple[int, list[str]]] = {}
    keep: list[Any] = []  # outputs stay alive, so no grad node's id is reused during the trace

    def feeders(tensors: list[Any]) -> list[str]:
        out: set[str] = set()
        seen: set[int] = set()
        stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if id(node) in produced:
                out.add(produced[id(node)])
                continue
            stack.extend(n for n, _ in (node.next_functions or ()) if n is not None)
        return sorted(out)

    def pre(mod: Any, args: Any) -> None:
        path = owners[id(mod)]
        fed = feeders(_tensors(args))
        order = found[path][0] if path in found else len(found)
        found[path] = (order, sorted(set(found.get(path, (0, []))[1]) | set(fed)))

    def post(mod: Any, args: Any, outputs: Any) -> None:
        for t in _tensors(outputs):
            if t.grad_fn is not None:
                keep.append(t)
                produced.setdefault(id(t.grad_fn), owners[id(mod)])

    modules = [(m, m.training) for m in model.modules()]
    hooks = []
    try:
        x = _probe_tensor(model, probe)
        for mod, _ in modules:
            if id(mod) in owners:
                hooks.append(mod.register_forward_pre_hook(pre))
                hooks.append(mod.register_forward_hook(post))
        model.eval()
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            model(x)
    except Exception as e:  # noqa: BLE001 - a probe that does not fit the model: try the next
        _log.debug("ckptcore: structure probe %s failed on %s: %s", probe, type(model).__name__, e)
        return None
    finally:
        for h in hooks:
            h.remove()
        for mod, training in modules:
            mod.training = training
    if set(found) != set(owners.values()):
        return None  # some modules never ran on the probe: a partial structure would mislead
    return found

"""Weight layouts: how one layer's arrays in one framework become the other's.

Everything here works from the two sides' :class:`~ckptcore.ParamInfo` alone (kind, role,
layout letters, attrs), so it needs neither framework.  A layer pair becomes a list of
:class:`Move`: one per target array, with the source arrays it is built from and two functions,
one for the weight and one for an optimizer slot of that weight.  The two differ only where a
layer's parameterisation differs (Paddle's LSTM splits Keras' one bias into ``bias_ih`` +
``bias_hh``); for every pure re-layout (transposes, gate reordering, the Flatten row
permutation) the slot gets exactly the weight's transform.

Layout letters (FRAMEWORKS.md §1.1): ``io`` Dense/Linear; convolutions ``kio``/``hwio``/``dhwio``
(Keras) and ``oik``/``oihw``/``oidhw`` (Paddle); transposed ``koi``/``hwoi`` and ``iok``/``iohw``;
Keras depthwise ``hwim`` and Paddle's grouped ``oihw`` of shape ``(in*M, 1, h, w)``.  Recurrent
layouts are gate orders (``ifco`` LSTM in both; GRU ``zrh`` in Keras, ``rzc`` in Paddle, where
``h`` and ``c`` both name the candidate) and ``attrs["axes"]`` says whether the gate axis comes
last (``io``, Keras) or first (``oi``, Paddle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..state import ParamInfo

Array = np.ndarray
Fn = Callable[[Sequence[Array]], Array]

__all__ = ["Move", "Unit", "plan_unit", "permute_letters", "flatten_permutation", "RNN_KINDS"]

RNN_KINDS = ("lstm", "gru", "simple_rnn")


@dataclass
class Unit:
    """One weight-owning layer (or one layer/direction of a Paddle multi-layer RNN)."""

    kind: str
    layer: str
    params: dict[str, str]          # role -> state name
    infos: dict[str, ParamInfo]     # role -> its description
    shapes: dict[str, tuple]        # role -> array shape
    label: str = ""                 # for messages
    framework: str = ""

    @property
    def main_size(self) -> int:
        for role in ("kernel", "embeddings", "depthwise_kernel", "gamma", "moving_mean", "beta", "bias"):
            if role in self.shapes:
                return int(np.prod(self.shapes[role]))
        return sum(int(np.prod(s)) for s in self.shapes.values())


@dataclass
class Move:
    """Build target array ``dst`` from source arrays ``src``; ``slot`` does the same for a slot."""

    dst: str
    src: tuple[str, ...]
    weight: Fn
    slot: Fn
    note: str = ""


class LayoutProblem(Exception):
    """A layer pair cannot be converted; the message says why (collected into one MigrationError)."""


def permute_letters(arr: Array, src: str, dst: str) -> Array:
    """Transpose ``arr`` from axis letters ``src`` to ``dst`` (``"hwio"`` -> ``"oihw"``)."""
    if sorted(src) != sorted(dst) or arr.ndim != len(src):
        raise LayoutProblem(f"cannot re-lay {arr.shape} from {src!r} to {dst!r}")
    return np.ascontiguousarray(np.transpose(arr, [src.index(c) for c in dst]))


# ----------------------------------------------------------------------------- Flatten order


def _flatten_facts(info: ParamInfo) -> tuple[str | None, list[int] | None, int | None]:
    a = info.attrs
    shape = a.get("input_shape")
    order = a.get("input_order")
    channels = a.get("input_channels")
    if shape is not None and order is not None and channels is None:
        channels = shape[-1] if order == "channels_last" else shape[0]
    return order, (list(shape) if shape is not None else None), channels


def flatten_permutation(src: ParamInfo, dst: ParamInfo, rows: int, *, src_fw: str = "",
                        dst_fw: str = "") -> tuple[np.ndarray | None, str]:
    """Row index array ``p`` with ``dst_kernel = src_kernel[p]`` for a Dense after a Flatten.

    ``p`` is ``None`` when no permutation is needed (same flattening order, or no feature map);
    the string says what was assumed, if anything.  When only one side knows the map and the
    other is Paddle, Paddle's default channels-first order is assumed (its adapter infers maps
    from layer definition order and cannot always tell).  Raises :class:`LayoutProblem` when the
    two sides disagree about the map's size.
    """
    s_order, s_shape, s_c = _flatten_facts(src)
    d_order, d_shape, d_c = _flatten_facts(dst)
    assumed = ""
    if (s_order is None) != (d_order is None):
        known = s_shape if s_order is not None else d_shape
        if (src_fw if s_order is None else dst_fw) == "paddle" and known is not None and len(known) >= 2:
            assumed = "channels_first (Paddle's default) assumed for the Linear layer's flattened input"
            if s_order is None:
                s_order, s_c = "channels_first", (d_c if d_c is not None else None)
            else:
                d_order, d_c = "channels_first", (s_c if s_c is not None else None)
    if s_order is None or d_order is None or s_order == d_order:
        return None, assumed
    # Spatial dims and channels, from whichever side knows the full shape.
    if s_shape is not None:
        spatial = s_shape[:-1] if s_order == "channels_last" else s_shape[1:]
        c = s_c
    elif d_shape is not None:
        spatial = d_shape[:-1] if d_order == "channels_last" else d_shape[1:]
        c = d_c
    else:
        raise LayoutProblem("neither side records the shape of the feature map this Dense layer "
                            "flattens, so its rows cannot be reordered")
    if s_c is not None and d_c is not None and s_c != d_c:
        raise LayoutProblem(f"the flattened feature map has {s_c} channels in the source but {d_c} "
                            "in the target")
    n = int(np.prod(spatial)) * int(c)
    if n != rows:
        raise LayoutProblem(f"the flattened feature map {spatial}x{c} has {n} features but the kernel "
                            f"has {rows} rows")
    idx = np.arange(n)
    if s_order == "channels_last":   # source row (spatial..., c); target row (c, spatial...)
        src_index = idx.reshape(*spatial, c)
        perm = np.moveaxis(src_index, -1, 0)
    else:                            # source (c, spatial...); target (spatial..., c)
        src_index = idx.reshape(c, *spatial)
        perm = np.moveaxis(src_index, 0, -1)
    return perm.reshape(-1), assumed


# ----------------------------------------------------------------------------- plain layers


def _same(xs: Sequence[Array]) -> Array:
    return xs[0]


def _kernel_fn(kind: str, s: ParamInfo, d: ParamInfo, s_shape: tuple, d_shape: tuple,
               fws: tuple[str, str] = ("", "")) -> tuple[Fn, str]:
    """The transform of a kernel-like array from ``s``'s layout to ``d``'s."""
    sl, dl = s.layout or "", d.layout or ""
    if kind == "depthwise_conv2d" and s.role == "kernel":
        if sl == "hwim" and dl == "oihw":       # (h,w,i,m) -> (i*m, 1, h, w), channel c*M+m
            h, w, i, m = s_shape
            return (lambda xs: np.ascontiguousarray(
                xs[0].transpose(2, 3, 0, 1).reshape(i * m, 1, h, w))), "hwim->(i*m)1hw"
        if sl == "oihw" and dl == "hwim":
            h, w, i, m = d_shape
            return (lambda xs: np.ascontiguousarray(
                xs[0].reshape(i, m, h, w).transpose(2, 3, 0, 1))), "(i*m)1hw->hwim"
    if kind == "dense" and s.role == "kernel":
        perm, assumed = (flatten_permutation(s, d, s_shape[0], src_fw=fws[0], dst_fw=fws[1])
                         if len(s_shape) == 2 else (None, ""))
        note = "; ".join(x for x in ("flatten rows reordered" if perm is not None else "", assumed) if x)
        if perm is not None:
            return (lambda xs: np.ascontiguousarray(xs[0][perm])), note
        return _same, note
    if sl and dl and sl != dl and sorted(sl) == sorted(dl) and len(sl) == len(s_shape):
        return (lambda xs: permute_letters(xs[0], sl, dl)), f"{sl}->{dl}"
    return _same, ""


def _plain_moves(src: Unit, dst: Unit) -> list[Move]:
    moves = []
    for role, dname in dst.params.items():
        if role not in src.params:
            raise LayoutProblem(f"the target's {role!r} ({dname}) has no counterpart in the source layer "
                                f"{src.layer} (roles {sorted(src.params)})")
        s, d = src.infos[role], dst.infos[role]
        fn, note = _kernel_fn(dst.kind, s, d, src.shapes[role], dst.shapes[role],
                              (src.framework, dst.framework))
        moves.append(Move(dname, (src.params[role],), fn, fn, note))
    extra = set(src.params) - set(dst.params)
    if extra:
        raise LayoutProblem(f"the source's {sorted(extra)} have no counterpart in the target layer "
                            f"{dst.layer} (roles {sorted(dst.params)})")
    return moves


# ----------------------------------------------------------------------------- recurrent layers


def _gates(layout: str | None, kind: str) -> str:
    g = (layout or "").replace("h", "c") if kind == "gru" else (layout or "")
    return g or {"lstm": "ifco", "gru": "zrc"}.get(kind, "")


def _reorder(arr: Array, src: str, dst: str, axis: int) -> Array:
    if src == dst or not src:
        return arr
    blocks = np.split(arr, len(src), axis=axis)
    return np.concatenate([blocks[src.index(g)] for g in dst], axis=axis)


def _is_keras_rnn(unit: Unit) -> bool:
    info = unit.infos.get("kernel")
    return info is not None and info.attrs.get("axes") == "io"


def _rnn_moves(src: Unit, dst: Unit) -> list[Move]:
    """LSTM/GRU between Keras (gate axis last, one or two bias rows) and Paddle (gate axis first,
    ``bias_ih`` and ``bias_hh``)."""
    kind = dst.kind
    k2p = _is_keras_rnn(src) and not _is_keras_rnn(dst)
    p2k = _is_keras_rnn(dst) and not _is_keras_rnn(src)
    if not (k2p or p2k):
        return _plain_moves(src, dst)
    if kind == "simple_rnn":
        raise LayoutProblem("SimpleRNN conversion is not supported")
    keras = src if k2p else dst
    if kind == "gru" and not keras.infos["kernel"].attrs.get("reset_after", True):
        raise LayoutProblem("Keras GRU(reset_after=False) applies the reset gate before the recurrent "
                            "matmul; Paddle's GRU always applies it after, so no weights reproduce it. "
                            "Use GRU(reset_after=True) (the Keras 3 default)")
    sg = _gates(src.infos["kernel"].layout, kind)
    dg = _gates(dst.infos["kernel"].layout, kind)
    moves: list[Move] = []
    for role in ("kernel", "recurrent_kernel"):
        if role not in dst.params or role not in src.params:
            raise LayoutProblem(f"the {kind} layer lacks its {role}")
        if k2p:   # (in, G*u) -> (G*u, in)
            fn = (lambda xs, sg=sg, dg=dg: np.ascontiguousarray(_reorder(xs[0], sg, dg, 1).T))
        else:
            fn = (lambda xs, sg=sg, dg=dg: np.ascontiguousarray(_reorder(xs[0], sg, dg, 0).T))
        moves.append(Move(dst.params[role], (src.params[role],), fn, fn, f"{sg}->{dg}, transposed"))
    if k2p:
        moves += _bias_k2p(src, dst, kind, sg, dg)
    else:
        moves += _bias_p2k(src, dst, kind, sg, dg)
    return moves


def _bias_k2p(src: Unit, dst: Unit, kind: str, sg: str, dg: str) -> list[Move]:
    if "bias" not in src.params:
        raise LayoutProblem(f"the Keras {kind} layer has no bias (use_bias=False) but Paddle's always "
                            "has two")
    b = src.params["bias"]
    if kind == "gru":   # (2, 3u): row 0 input bias, row 1 recurrent bias
        ih = (lambda xs: np.ascontiguousarray(_reorder(xs[0][0], sg, dg, 0)))
        hh = (lambda xs: np.ascontiguousarray(_reorder(xs[0][1], sg, dg, 0)))
        return [Move(dst.params["bias"], (b,), ih, ih), Move(dst.params["recurrent_bias"], (b,), hh, hh)]
    ih = (lambda xs: np.ascontiguousarray(_reorder(xs[0], sg, dg, 0)))
    # Paddle adds two bias vectors that receive the same gradient: put the value in one and zeros in
    # the other; each slot gets the Keras bias' slot (the gradient history both would have seen).
    zero = (lambda xs: np.zeros_like(_reorder(xs[0], sg, dg, 0)))
    return [Move(dst.params["bias"], (b,), ih, ih),
            Move(dst.params["recurrent_bias"], (b,), zero, ih, note="lstm_split_bias")]


def _bias_p2k(src: Unit, dst: Unit, kind: str, sg: str, dg: str) -> list[Move]:
    if "bias" not in dst.params:
        raise LayoutProblem(f"the Keras {kind} layer has no bias (use_bias=False) but Paddle's has two")
    ih, hh = src.params.get("bias"), src.params.get("recurrent_bias")
    if ih is None or hh is None:
        raise LayoutProblem(f"the Paddle {kind} layer lacks bias_ih/bias_hh")
    if kind == "gru":
        fn = (lambda xs: np.ascontiguousarray(np.stack([_reorder(xs[0], sg, dg, 0), _reorder(xs[1], sg, dg, 0)])))
        return [Move(dst.params["bias"], (ih, hh), fn, fn)]
    w = (lambda xs: np.ascontiguousarray(_reorder(xs[0] + xs[1], sg, dg, 0)))
    s = (lambda xs: np.ascontiguousarray(_reorder((xs[0] + xs[1]) / 2, sg, dg, 0)))
    return [Move(dst.params["bias"], (ih, hh), w, s, note="lstm_merged_bias")]


# ----------------------------------------------------------------------------- entry point


def plan_unit(src: Unit, dst: Unit) -> list[Move]:
    """The moves that turn layer ``src`` into layer ``dst``; :class:`LayoutProblem` if impossible."""
    if src.kind != dst.kind:
        raise LayoutProblem(f"layer kinds differ: {src.kind} vs {dst.kind}")
    if dst.kind in RNN_KINDS:
        return _rnn_moves(src, dst)
    return _plain_moves(src, dst)


def layer_hyperparams(unit: Unit) -> dict[str, float]:
    """Normalisation hyperparameters that change outputs (epsilon) or statistics (momentum)."""
    info = next(iter(unit.infos.values()))
    return {k: float(info.attrs[k]) for k in ("epsilon", "momentum")
            if isinstance(info.attrs.get(k), (int, float)) and not isinstance(info.attrs.get(k), bool)}

"""Weight layouts: how one layer's arrays on one side become the other side's.

Everything here works from the two sides' :class:`~ckptcore.ParamInfo` alone (kind, role,
layout letters, attrs) and the flattening default of each side's dialect, so it needs no
framework.  A layer pair becomes a list of :class:`Move`: one per target array, with the source
arrays it is built from and two functions, one for the weight and one for an optimizer slot of
that weight.  The two differ only where a layer's parameterisation differs (one recurrent bias
split into input and recurrent biases); for every pure re-layout (transposes, gate reordering,
the Flatten row permutation) the slot gets exactly the weight's transform.

Layout letters are those of :mod:`ckptcore.vocab` (``io`` dense; convolutions ``kio``/``hwio``/
``dhwio`` or ``oik``/``oihw``/``oidhw``; transposed convolutions ``koi``/``hwoi`` or ``iok``/
``iohw``, or ``hwio`` with ``attrs["spatially_flipped"]``; depthwise ``hwim``, or a grouped ``oihw``
of shape ``(in*M, 1, h, w)`` or ``hwio`` of shape ``(h, w, 1, in*M)``).  Recurrent
layouts are gate orders (``ifco`` LSTM; GRU ``zrh`` or ``rzc``, where ``h`` and ``c`` both name the
candidate) and ``attrs["axes"]`` says whether the gate axis comes last (``io``) or first (``oi``).
The recurrent bias takes one of three forms, read from the roles and shapes: *single* (one
``bias`` vector), *stacked* (one ``bias`` of shape ``(2, G*u)``: input row, recurrent row) or
*split* (``bias`` and ``recurrent_bias`` vectors).  docs/MIGRATION.md, section "Framework facts
migration relies on", lists which framework uses which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..state import ParamInfo
from ..vocab import Kind, Role

Array = np.ndarray
Fn = Callable[[Sequence[Array]], Array]

__all__ = ["Move", "Unit", "plan_unit", "permute_letters", "flatten_permutation", "RNN_KINDS",
           "SPLIT_BIAS", "MERGED_BIAS"]

RNN_KINDS = (Kind.LSTM, Kind.GRU, Kind.SIMPLE_RNN)
# Move notes for a recurrent bias split in two or merged into one (the training caveat in convert).
SPLIT_BIAS, MERGED_BIAS = "bias_split", "bias_merged"
NORM_KINDS = (Kind.BATCH_NORM, Kind.LAYER_NORM, Kind.GROUP_NORM)


@dataclass
class Unit:
    """One weight-owning layer (or one layer/direction of a multi-layer RNN)."""

    kind: str
    layer: str
    params: dict[str, str]          # role -> state name
    infos: dict[str, ParamInfo]     # role -> its description
    shapes: dict[str, tuple]        # role -> array shape
    label: str = ""                 # for messages
    framework: str = ""             # for messages
    flatten_default: str | None = None   # the side's dialect's default_flatten_order

    @property
    def main_size(self) -> int:
        for role in (Role.KERNEL, Role.EMBEDDINGS, Role.DEPTHWISE_KERNEL, Role.GAMMA, Role.MOVING_MEAN,
                     Role.BETA, Role.BIAS):
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


def flatten_permutation(src: ParamInfo, dst: ParamInfo, rows: int, *, src_default: str | None = None,
                        dst_default: str | None = None, src_fw: str = "", dst_fw: str = ""
                        ) -> tuple[np.ndarray | None, str]:
    """Row index array ``p`` with ``dst_kernel = src_kernel[p]`` for a Dense after a Flatten.

    ``p`` is ``None`` when no permutation is needed (same flattening order, or no feature map);
    the string says what was assumed, if anything.  When only one side knows the map, the other
    side's dialect default (``src_default``/``dst_default``, its ``default_flatten_order``) is
    assumed: some adapters infer maps from layer definition order and cannot always tell.  Raises
    :class:`LayoutProblem` when the two sides disagree about the map's size.
    """
    s_order, s_shape, s_c = _flatten_facts(src)
    d_order, d_shape, d_c = _flatten_facts(dst)
    assumed = ""
    if (s_order is None) != (d_order is None):
        known = s_shape if s_order is not None else d_shape
        default, fw = (src_default, src_fw) if s_order is None else (dst_default, dst_fw)
        if default is not None and known is not None and len(known) >= 2:
            assumed = f"{default} (the {fw} default) assumed for the dense layer's flattened input"
            if s_order is None:
                s_order, s_c = default, (d_c if d_c is not None else None)
            else:
                d_order, d_c = default, (s_c if s_c is not None else None)
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
    if n == rows and int(np.prod(spatial)) == 1:
        return None, ""   # a 1x1 map (after global pooling) flattens the same in either order
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
               src: Unit, dst: Unit) -> tuple[Fn, str]:
    """The transform of a kernel-like array from ``s``'s layout to ``d``'s, flipping its spatial
    axes when one side keeps a transposed convolution's kernel spatially flipped
    (``attrs["spatially_flipped"]``: applied as a convolution of the dilated input)."""
    fn, note = _relayout_fn(kind, s, d, s_shape, d_shape, src, dst)
    if bool(s.attrs.get("spatially_flipped")) == bool(d.attrs.get("spatially_flipped")):
        return fn, note
    dl = d.layout or ""
    axes = tuple(i for i, c in enumerate(dl) if c not in "io")
    if not dl or len(dl) != len(d_shape):
        raise LayoutProblem(f"cannot flip a kernel of unknown layout {dl!r}")
    return (lambda xs: np.ascontiguousarray(np.flip(fn(xs), axes))), "; ".join(
        x for x in (note, "spatially flipped") if x)


def _relayout_fn(kind: str, s: ParamInfo, d: ParamInfo, s_shape: tuple, d_shape: tuple,
                 src: Unit, dst: Unit) -> tuple[Fn, str]:
    sl, dl = s.layout or "", d.layout or ""
    if kind == Kind.DEPTHWISE_CONV2D and s.role == Role.KERNEL:
        # A depthwise kernel as a grouped "hwio" of shape (h, w, 1, i*m), channel c*M+m.
        if sl == "hwim" and dl == "hwio":
            h, w, i, m = s_shape
            return (lambda xs: np.ascontiguousarray(xs[0].reshape(h, w, 1, i * m))), "hwim->hw1(i*m)"
        if sl == "hwio" and dl == "hwim":
            h, w, i, m = d_shape
            return (lambda xs: np.ascontiguousarray(xs[0].reshape(h, w, i, m))), "hw1(i*m)->hwim"
        if sl == "hwim" and dl == "oihw":       # (h,w,i,m) -> (i*m, 1, h, w), channel c*M+m
            h, w, i, m = s_shape
            return (lambda xs: np.ascontiguousarray(
                xs[0].transpose(2, 3, 0, 1).reshape(i * m, 1, h, w))), "hwim->(i*m)1hw"
        if sl == "oihw" and dl == "hwim":
            h, w, i, m = d_shape
            return (lambda xs: np.ascontiguousarray(
                xs[0].reshape(i, m, h, w).transpose(2, 3, 0, 1))), "(i*m)1hw->hwim"
    if kind == Kind.DENSE and s.role == Role.KERNEL:
        # Kernels are [in, out] ("io", also when not recorded) or [out, in] ("oi"); the Flatten
        # permutation reorders the input rows, so it is applied in the "io" layout.
        s_io, d_io = (sl or "io") == "io", (dl or "io") == "io"
        rows = s_shape[0] if s_io else s_shape[-1]
        perm, assumed = (flatten_permutation(s, d, rows, src_default=src.flatten_default,
                                             dst_default=dst.flatten_default, src_fw=src.framework,
                                             dst_fw=dst.framework)
                         if len(s_shape) == 2 else (None, ""))
        note = "; ".join(x for x in ("flatten rows reordered" if perm is not None else "",
                                     "transposed" if s_io != d_io and len(s_shape) == 2 else "", assumed) if x)
        if len(s_shape) != 2 or (perm is None and s_io == d_io):
            return _same, note

        def dense(xs: Sequence[Array]) -> Array:
            k = xs[0] if s_io else xs[0].T
            if perm is not None:
                k = k[perm]
            return np.ascontiguousarray(k if d_io else k.T)
        return dense, note
    if sl and dl and sl != dl and sorted(sl) == sorted(dl) and len(sl) == len(s_shape):
        return (lambda xs: permute_letters(xs[0], sl, dl)), f"{sl}->{dl}"
    return _same, ""


def optional(info: ParamInfo | None) -> bool:
    """An array its framework alone keeps and nothing else needs (``attrs["optional"]``, e.g. a
    BatchNorm's count of batches seen): a source's is left behind, a target's keeps its own value."""
    return bool(info is not None and info.attrs.get("optional"))


def _plain_moves(src: Unit, dst: Unit) -> list[Move]:
    moves = []
    for role, dname in dst.params.items():
        if role not in src.params and optional(dst.infos[role]):
            continue
        if role not in src.params:
            raise LayoutProblem(f"the target's {role!r} ({dname}) has no counterpart in the source layer "
                                f"{src.layer} (roles {sorted(src.params)})")
        s, d = src.infos[role], dst.infos[role]
        fn, note = _kernel_fn(dst.kind, s, d, src.shapes[role], dst.shapes[role], src, dst)
        moves.append(Move(dname, (src.params[role],), fn, fn, note))
    extra = {r for r in set(src.params) - set(dst.params) if not optional(src.infos[r])}
    if extra:
        raise LayoutProblem(f"the source's {sorted(extra)} have no counterpart in the target layer "
                            f"{dst.layer} (roles {sorted(dst.params)})")
    return moves


# ----------------------------------------------------------------------------- recurrent layers


def _gates(layout: str | None, kind: str) -> str:
    g = (layout or "").replace("h", "c") if kind == Kind.GRU else (layout or "")
    return g or {Kind.LSTM: "ifco", Kind.GRU: "zrc"}.get(kind, "")


def _reorder(arr: Array, src: str, dst: str, axis: int) -> Array:
    if src == dst or not src:
        return arr
    blocks = np.split(arr, len(src), axis=axis)
    return np.concatenate([blocks[src.index(g)] for g in dst], axis=axis)


def _axes(unit: Unit) -> str:
    """``io`` (gate axis last) or ``oi`` (gate axis first, also assumed when not recorded)."""
    info = unit.infos.get(Role.KERNEL)
    return "io" if info is not None and info.attrs.get("axes") == "io" else "oi"


def _bias_form(unit: Unit) -> str | None:
    if Role.RECURRENT_BIAS in unit.params:
        return "split"
    if Role.BIAS in unit.params:
        return "stacked" if len(unit.shapes[Role.BIAS]) == 2 else "single"
    return None


def _reset_after(unit: Unit) -> bool:
    info = unit.infos.get(Role.KERNEL)
    return bool(info.attrs.get("reset_after", True)) if info is not None else True


def _rnn_moves(src: Unit, dst: Unit) -> list[Move]:
    """LSTM/GRU between gate axes (last or first), gate orders and bias forms."""
    kind = dst.kind
    sa, da = _axes(src), _axes(dst)
    sb, db = _bias_form(src), _bias_form(dst)
    sg = _gates(src.infos[Role.KERNEL].layout, kind) if Role.KERNEL in src.infos else ""
    dg = _gates(dst.infos[Role.KERNEL].layout, kind) if Role.KERNEL in dst.infos else ""
    if sa == da and sb == db and sg == dg:
        return _plain_moves(src, dst)
    if kind == Kind.SIMPLE_RNN:
        raise LayoutProblem("SimpleRNN conversion is not supported")
    if kind == Kind.GRU and not (_reset_after(src) and _reset_after(dst)):
        raise LayoutProblem("GRU(reset_after=False) applies the reset gate before the recurrent "
                            "matmul, the other side after it, so no weights reproduce it. "
                            "Use GRU(reset_after=True) on both sides")
    moves: list[Move] = []
    for role in (Role.KERNEL, Role.RECURRENT_KERNEL):
        if role not in dst.params or role not in src.params:
            raise LayoutProblem(f"the {kind} layer lacks its {role}")
        gate_axis = 1 if sa == "io" else 0      # (in, G*u) or (G*u, in)
        if sa != da:
            fn = (lambda xs, sg=sg, dg=dg, ax=gate_axis: np.ascontiguousarray(_reorder(xs[0], sg, dg, ax).T))
            note = f"{sg}->{dg}, transposed"
        else:
            fn = (lambda xs, sg=sg, dg=dg, ax=gate_axis: np.ascontiguousarray(_reorder(xs[0], sg, dg, ax)))
            note = f"{sg}->{dg}"
        moves.append(Move(dst.params[role], (src.params[role],), fn, fn, note))
    return moves + _bias_moves(src, dst, kind, sb, db, sg, dg)


def _vec(sg: str, dg: str, row: int | None = None) -> Fn:
    if row is None:
        return lambda xs: np.ascontiguousarray(_reorder(xs[0], sg, dg, 0))
    return lambda xs: np.ascontiguousarray(_reorder(xs[0][row], sg, dg, 0))


def _bias_moves(src: Unit, dst: Unit, kind: str, sb: str | None, db: str | None, sg: str, dg: str
                ) -> list[Move]:
    if sb is None or db is None:
        if sb == db:
            return []
        raise LayoutProblem(f"the {'source' if sb is None else 'target'} {kind} layer has no bias "
                            f"(use_bias=False) but the other side's has a {sb or db} bias")
    b, B, RB = src.params.get(Role.BIAS), dst.params.get(Role.BIAS), dst.params.get(Role.RECURRENT_BIAS)
    if sb == db == "single":
        f = _vec(sg, dg)
        return [Move(B, (b,), f, f)]
    if sb == db == "stacked":
        f = (lambda xs: np.ascontiguousarray(np.stack([_reorder(xs[0][0], sg, dg, 0),
                                                       _reorder(xs[0][1], sg, dg, 0)])))
        return [Move(B, (b,), f, f)]
    if sb == db == "split":
        f = _vec(sg, dg)
        return [Move(B, (b,), f, f), Move(RB, (src.params[Role.RECURRENT_BIAS],), f, f)]
    if sb == "stacked" and db == "split":   # row 0 the input bias, row 1 the recurrent bias
        ih, hh = _vec(sg, dg, 0), _vec(sg, dg, 1)
        return [Move(B, (b,), ih, ih), Move(RB, (b,), hh, hh)]
    if sb == "split" and db == "stacked":
        f = (lambda xs: np.ascontiguousarray(np.stack([_reorder(xs[0], sg, dg, 0), _reorder(xs[1], sg, dg, 0)])))
        return [Move(B, (b, src.params[Role.RECURRENT_BIAS]), f, f)]
    if sb == "single" and db == "split":
        ih = _vec(sg, dg)
        # Two bias vectors that receive the same gradient: the value goes into one and zeros into the
        # other; each slot gets the single bias' slot (the gradient history both would have seen).
        zero = (lambda xs: np.zeros_like(_reorder(xs[0], sg, dg, 0)))
        return [Move(B, (b,), ih, ih), Move(RB, (b,), zero, ih, note=SPLIT_BIAS)]
    if sb == "split" and db == "single":
        hh = src.params[Role.RECURRENT_BIAS]
        w = (lambda xs: np.ascontiguousarray(_reorder(xs[0] + xs[1], sg, dg, 0)))
        s = (lambda xs: np.ascontiguousarray(_reorder((xs[0] + xs[1]) / 2, sg, dg, 0)))
        return [Move(B, (b, hh), w, s, note=MERGED_BIAS)]
    raise LayoutProblem(f"a {sb} {kind} bias cannot become a {db} one")


# ----------------------------------------------------------------------------- entry point


def plan_unit(src: Unit, dst: Unit) -> list[Move]:
    """The moves that turn layer ``src`` into layer ``dst``; :class:`LayoutProblem` if impossible."""
    if src.kind != dst.kind:
        raise LayoutProblem(f"layer kinds differ: {src.kind} vs {dst.kind}")
    if dst.kind in RNN_KINDS:
        return _rnn_moves(src, dst)
    if dst.kind == Kind.MULTI_HEAD_ATTENTION:
        return _attention_moves(src, dst)
    return _plain_moves(src, dst)


# ----------------------------------------------------------------------------- attention
# A multi-head attention layer's arrays, by role: "<p>_kernel"/"<p>_bias" for the projections p in
# query, key, value, output, or the packed "qkv_kernel"/"qkv_bias" (query, key and value stacked on
# the output axis).  Kernel layouts: "ehd" ([in, heads, head_dim]), "hde" (output: [heads,
# head_dim, out]), "io" or "oi" (2-D, the heads-by-head_dim axis flattened head-major); biases
# "hd" or 1-D.  Every conversion goes through the 2-D [in, out] matrix of each projection.

_PROJECTIONS = ("query", "key", "value")


def _to_io(arr: Array, layout: str | None) -> Array:
    if layout == "hd":
        return arr.reshape(-1)
    if layout == "ehd":
        return arr.reshape(arr.shape[0], -1)
    if layout == "hde":
        return arr.reshape(-1, arr.shape[-1])
    if layout == "oi":
        return arr.T
    return arr if arr.ndim == 2 else arr.reshape(-1)   # "io", or a bias ("hd" or 1-D)


def _from_io(mat: Array, layout: str | None, shape: tuple) -> Array:
    if layout == "oi":
        mat = mat.T
    return np.ascontiguousarray(mat.reshape(shape))


def _attention_parts(unit: Unit) -> dict[tuple[str, str], tuple[str, str | None, int | None]]:
    """``(projection, "kernel"|"bias") -> (role, layout, packed index or None)`` of ``unit``."""
    out: dict[tuple[str, str], tuple[str, str | None, int | None]] = {}
    for role, info in unit.infos.items():
        proj, _, what = str(role).rpartition("_")
        if what not in ("kernel", "bias") or proj not in (*_PROJECTIONS, "output", "qkv"):
            raise LayoutProblem(f"the attention layer {unit.layer} has a {role!r} no other framework has")
        if proj == "qkv":
            for i, p in enumerate(_PROJECTIONS):
                out[(p, what)] = (str(role), info.layout, i)
        else:
            out[(proj, what)] = (str(role), info.layout, None)
    return out


def _attention_moves(src: Unit, dst: Unit) -> list[Move]:
    sp, dp = _attention_parts(src), _attention_parts(dst)
    if set(sp) != set(dp):
        raise LayoutProblem(f"the attention layers' projections differ: source {sorted(map('_'.join, sp))}, "
                            f"target {sorted(map('_'.join, dp))} (one has biases or a key/value the other lacks)")
    moves: list[Move] = []
    for role, dname in dst.params.items():
        parts = sorted((k, v) for k, v in dp.items() if v[0] == str(role))
        keys = [k for k, _ in sorted(parts, key=lambda kv: kv[1][2] or 0)]
        layout = dst.infos[role].layout
        shape = dst.shapes[role]
        srcs: list[str] = []
        plan: list[tuple[int, str | None, int | None]] = []   # (index into srcs, layout, packed index)
        for k in keys:
            srole, slayout, packed = sp[k]
            name = src.params[srole]
            if name not in srcs:
                srcs.append(name)
            plan.append((srcs.index(name), slayout, packed))

        def fn(xs: Sequence[Array], plan=plan, layout=layout, shape=shape) -> Array:
            mats = []
            for i, slayout, packed in plan:
                m = _to_io(xs[i], slayout)
                if packed is not None:   # one third of the packed output axis
                    m = np.split(m, 3, axis=-1)[packed]
                mats.append(m)
            return _from_io(np.concatenate(mats, axis=-1) if len(mats) > 1 else mats[0], layout, shape)
        moves.append(Move(dname, tuple(srcs), fn, fn, "attention re-laid"))
    return moves


def layer_hyperparams(unit: Unit) -> dict[str, float]:
    """Normalisation hyperparameters that change outputs (epsilon) or statistics (momentum)."""
    # ParamInfo records a normalisation's momentum as moving = moving*momentum + batch*(1-momentum)
    # whatever the framework's own convention; its adapter converts.
    info = next(iter(unit.infos.values()))
    return {k: float(info.attrs[k]) for k in ("epsilon", "momentum")
            if isinstance(info.attrs.get(k), (int, float)) and not isinstance(info.attrs.get(k), bool)}

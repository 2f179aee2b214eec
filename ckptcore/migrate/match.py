"""Which source layer becomes which target layer.

Every adapter describes its parameters with a :class:`~ckptcore.ParamInfo`; parameters sharing an
``index`` form a layer (a :class:`~.layouts.Unit`).  A multi-layer or bidirectional RNN may be one
layer in one framework and several in another (one per layer and direction), so it is split into
one unit per ``(attrs["layer_index"], attrs["direction"])``.  The two unit lists are aligned in
order by kind and size (an
LCS alignment, so one extra or missing layer is reported as such instead of shifting every later
pair); ``name_map`` pins pairs first.

When both sides record their structure (``attrs["inputs"]``: the weight-owning layers feeding a
layer; ``attrs["order"]``: its run position), the layers are paired as nodes of two graphs first:
colour refinement gives each layer a colour from its kind, size and, recursively, its neighbours'
colours, so the two BatchNorms of a residual block's main branch and shortcut differ by the
convolution feeding them.  Layers of one colour pair one to one; several of one colour pair in run
order only when each feeds the next (a chain of identical blocks), since then the order is forced by
the data flow.  Otherwise, and whenever a side's structure is unknown and a (kind, size) occurs more
than once on both sides, the pairing is refused with the ``name_map`` to pass: a guess could pair
the wrong layers silently.  Every source parameter that finds no place and every target
parameter that gets no value is reported with the reason, all at once.
"""

from __future__ import annotations

from typing import Mapping

from ..state import ParamInfo, TrainingState
from ..vocab import Kind, Role
from .layouts import RNN_KINDS, LayoutProblem, Move, Unit, plan_unit

__all__ = ["units_of", "match_units", "plan_moves"]

_DIRECTIONS = {"forward": 0, "backward": 1, "reverse": 1}


def units_of(state: TrainingState, side: str, flatten_default: str | None = None
             ) -> tuple[list[Unit], dict[str, str]]:
    """The state's layers in model order, and the parameters no layer claims (name -> why).

    ``flatten_default`` is the side's dialect's ``default_flatten_order``."""
    groups: dict[tuple, dict[str, tuple[str, ParamInfo]]] = {}
    loose: dict[str, str] = {}
    first_index: dict[str, int] = {}
    for name in state.model:
        info = state.params.get(name)
        if info is None:
            loose[name] = "it has no ParamInfo (captured by an adapter that does not describe parameters)"
            continue
        if info.index < 0:
            if info.role != Role.SEED_STATE:
                loose[name] = f"it is a {info.kind!r} variable outside any layer ({info.role})"
            continue
        sub: tuple = ()
        if info.kind == Kind.MULTI_HEAD_ATTENTION:
            # one unit per attention layer, even where an adapter numbers its projections apart
            info_index = first_index.setdefault(info.layer, info.index)
        else:
            info_index = info.index
        if info.kind in RNN_KINDS:
            sub = (int(info.attrs.get("layer_index", 0)),
                   _DIRECTIONS.get(str(info.attrs.get("direction", "forward")), 0))
        key = (info_index, sub)
        roles = groups.setdefault(key, {})
        if info.role in roles:
            loose[name] = f"layer {info.layer} already has a {info.role!r} ({roles[info.role][0]})"
            continue
        roles[info.role] = (name, info)
    units = []
    for key in sorted(groups):
        roles = groups[key]
        first = next(iter(roles.values()))[1]
        label = first.layer
        if key[1] and sum(1 for k in groups if k[0] == key[0]) > 1:   # one of several RNN layers/directions
            label += f"[layer {key[1][0]}, {'reverse' if key[1][1] else 'forward'}]"
        units.append(Unit(kind=first.kind, layer=first.layer,
                          params={r: n for r, (n, _) in roles.items()},
                          infos={r: i for r, (_, i) in roles.items()},
                          shapes={r: tuple(state.model[n].shape) for r, (n, _) in roles.items()},
                          label=f"{side} layer {label} ({first.kind})",
                          framework=state.framework or "", flatten_default=flatten_default))
    return units, loose


def _compatible(a: Unit, b: Unit) -> bool:
    return a.kind == b.kind and a.main_size == b.main_size


def _lcs(src: list[Unit], dst: list[Unit]) -> list[tuple[int, int]]:
    n, m = len(src), len(dst)
    best = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            best[i][j] = (best[i + 1][j + 1] + 1 if _compatible(src[i], dst[j])
                          else max(best[i + 1][j], best[i][j + 1]))
    pairs, i, j = [], 0, 0
    while i < n and j < m:
        if _compatible(src[i], dst[j]) and best[i][j] == best[i + 1][j + 1] + 1:
            pairs.append((i, j))
            i, j = i + 1, j + 1
        elif best[i + 1][j] >= best[i][j + 1]:
            i += 1
        else:
            j += 1
    return pairs


def _unique_leftovers(src: list[Unit], dst: list[Unit], left_s: set[int], left_d: set[int]
                      ) -> list[tuple[int, int]]:
    """Pair layers the ordered alignment left over when their (kind, size) occurs once on each side.

    Multi-branch models may list their layers in different orders in two frameworks (one by graph
    depth, another by definition), so an ordered alignment alone leaves whole branches out.
    """
    def by_sig(units: list[Unit], idx: set[int]) -> dict[tuple, list[int]]:
        out: dict[tuple, list[int]] = {}
        for i in sorted(idx):
            out.setdefault((units[i].kind, units[i].main_size), []).append(i)
        return out
    ss, dd = by_sig(src, left_s), by_sig(dst, left_d)
    return [(ss[k][0], dd[k][0]) for k in ss if len(ss[k]) == 1 and len(dd.get(k, ())) == 1]


def _find(units: list[Unit], key: str) -> int | None:
    for i, u in enumerate(units):
        if key in u.params.values() or key == u.layer:
            return i
    return None


def _graph(units: list[Unit]) -> tuple[list[list[int]], list[int]] | None:
    """Each unit's feeding units and its run position, from ``attrs["inputs"]``/``attrs["order"]``;
    None when any unit's structure is unknown."""
    attrs = [next(iter(u.infos.values())).attrs if u.infos else {} for u in units]
    if not units or any("inputs" not in a for a in attrs):
        return None
    by_layer: dict[str, list[int]] = {}
    for i, u in enumerate(units):
        by_layer.setdefault(u.layer, []).append(i)
    preds = [sorted({j for layer in a["inputs"] for j in by_layer.get(str(layer), ()) if j != i})
             for i, a in enumerate(attrs)]
    order = [int(a.get("order", i)) for i, a in enumerate(attrs)]
    return preds, order


def _ancestors(preds: list[list[int]]) -> list[set[int]]:
    """Every unit's transitive feeders; iterative (a deep chain would exhaust Python's recursion)."""
    anc: list[set[int] | None] = [None] * len(preds)
    for root in range(len(preds)):
        stack = [root]
        while stack:
            i = stack[-1]
            if anc[i] is not None:
                stack.pop()
                continue
            todo = [p for p in preds[i] if anc[p] is None and p not in stack]
            if todo:
                stack.extend(todo)
                continue
            acc: set[int] = set()
            for p in preds[i]:
                acc |= {p} | (anc[p] or set())   # a (malformed) cycle leaves a member's set empty
            anc[i] = acc
            stack.pop()
    return [a or set() for a in anc]


def _refine(labels: list, preds: list[list[int]]) -> list[int]:
    """Weisfeiler-Lehman colour refinement over both graphs at once: a unit's colour becomes its
    colour plus the multisets of the colours feeding it and fed by it, until no class splits."""
    succs: list[list[int]] = [[] for _ in preds]
    for i, ps in enumerate(preds):
        for p in ps:
            succs[p].append(i)
    table = {lab: k for k, lab in enumerate(sorted(set(map(repr, labels))))}
    colour = [table[repr(lab)] for lab in labels]
    for _ in range(len(labels)):
        sig = [(colour[i], tuple(sorted(colour[p] for p in preds[i])),
                tuple(sorted(colour[c] for c in succs[i]))) for i in range(len(labels))]
        table = {lab: k for k, lab in enumerate(sorted(set(sig)))}
        new = [table[x] for x in sig]
        if len(set(new)) == len(set(colour)):
            return new
        colour = new
    return colour


def _ambiguity(src: list[Unit], dst: list[Unit], s_idx: list[int], d_idx: list[int], why: str) -> str:
    pairs = ", ".join(f"{src[i].layer!r}: {dst[j].layer!r}" for i, j in zip(s_idx, d_idx))
    return (f"cannot tell apart the source layers {', '.join(repr(src[i].layer) for i in s_idx)} and the "
            f"target layers {', '.join(repr(dst[j].layer) for j in d_idx)} ({src[s_idx[0]].kind}, "
            f"{src[s_idx[0]].main_size} values each): {why}. Pin the pairs, for example "
            f"name_map={{{pairs}}} if they correspond in this order")


def _structural(src: list[Unit], dst: list[Unit], pinned: list[tuple[int, int]], dropped: set[int],
                problems: list[str]) -> tuple[list[tuple[int, int]], set[int], set[int]]:
    """Pairs the two graphs determine, and the source/target units they leave to the ordered fallback
    (those whose neighbourhoods have no match).  Units that could swap go to ``problems``."""
    gs, gd = _graph(src), _graph(dst)
    if gs is None or gd is None:
        return [], set(), set()
    n = len(src)
    pin_of = {i: k for k, (i, _) in enumerate(pinned)} | {n + j: k for k, (_, j) in enumerate(pinned)}
    labels: list = []
    for i, u in enumerate(src + dst):
        if i in pin_of:
            labels.append(("pin", pin_of[i]))
        elif i < n and i in dropped:
            labels.append(("dropped", i))
        else:
            labels.append((str(u.kind), u.main_size))
    preds = gs[0] + [[p + n for p in ps] for ps in gd[0]]
    if dropped:   # a dropped source layer is not in the target: its consumers read what it read
        def through(i: int, seen: set[int]) -> set[int]:
            out: set[int] = set()
            for p in preds[i]:
                if p in dropped and p not in seen:
                    out |= through(p, seen | {p})
                elif p not in dropped:
                    out.add(p)
            return out
        preds = [[] if i in dropped else sorted(through(i, set())) if i < n else ps
                 for i, ps in enumerate(preds)]
    order = gs[1] + gd[1]
    colour = _refine(labels, preds)
    anc = _ancestors(preds)
    classes: dict[int, tuple[list[int], list[int]]] = {}
    for i in range(n + len(dst)):
        if i in pin_of or (i < n and i in dropped):
            continue
        classes.setdefault(colour[i], ([], []))[i >= n].append(i)
    pairs: list[tuple[int, int]] = []
    claimed_s: set[int] = set()
    claimed_d: set[int] = set()
    for ss, dd in classes.values():
        if len(ss) != len(dd) or not ss:
            continue   # the graphs differ here: left to the ordered fallback
        ss, dd = sorted(ss, key=lambda i: order[i]), sorted(dd, key=lambda i: order[i])
        chained = all(a in anc[b] for side in (ss, dd) for a, b in zip(side, side[1:]))
        if len(ss) == 1 or chained:   # one each, or each one feeds the next: order decides
            pairs.extend((i, j - n) for i, j in zip(ss, dd))
            continue
        problems.append(_ambiguity(src, dst, ss, [j - n for j in dd],
                                   "they have the same kind, size and neighbourhood, and neither feeds "
                                   "the other"))
        claimed_s.update(ss)
        claimed_d.update(j - n for j in dd)
    return pairs, claimed_s | {p[0] for p in pairs}, claimed_d | {p[1] for p in pairs}


def _unsafe(src: list[Unit], dst: list[Unit], auto: list[tuple[int, int]], free_s: list[int],
            free_d: list[int], problems: list[str], why: str) -> tuple[list[tuple[int, int]], set[tuple]]:
    """Drop the ordered fallback's pairs of a (kind, size) that occurs more than once on both sides:
    without structure nothing says which of them is which."""
    def count(units: list[Unit], idx: list[int]) -> dict[tuple, list[int]]:
        out: dict[tuple, list[int]] = {}
        for i in idx:
            out.setdefault((units[i].kind, units[i].main_size), []).append(i)
        return out
    cs, cd = count(src, free_s), count(dst, free_d)
    bad = {k for k in cs if len(cs[k]) > 1 and len(cd.get(k, ())) > 1}
    for k in sorted(bad, key=lambda k: cs[k][0]):
        problems.append(_ambiguity(src, dst, cs[k], cd[k], why))
    return [(i, j) for i, j in auto if (src[i].kind, src[i].main_size) not in bad], bad


def match_units(src: list[Unit], dst: list[Unit], name_map: Mapping[str, str | None] | None,
                problems: list[str]) -> list[tuple[Unit, Unit]]:
    """Pairs of (source unit, target unit); what cannot be paired goes to ``problems``.

    With both sides' structure known (``attrs["inputs"]``), layers are paired as nodes of two graphs
    (:func:`_structural`); what the graphs leave, and everything when either side's structure is
    unknown, is aligned in order by kind and size, refusing any (kind, size) that could swap.
    """
    pinned: list[tuple[int, int]] = []
    dropped: set[int] = set()
    for s_key, d_key in (name_map or {}).items():
        i = _find(src, s_key)
        if i is None:
            problems.append(f"name_map: {s_key!r} is neither a parameter nor a layer of the source")
            continue
        if d_key is None:
            dropped.add(i)
            continue
        j = _find(dst, d_key)
        if j is None:
            problems.append(f"name_map: {d_key!r} is neither a parameter nor a layer of the target")
            continue
        if any(p[0] == i or p[1] == j for p in pinned):
            if (i, j) not in pinned:
                problems.append(f"name_map: {s_key!r} -> {d_key!r} conflicts with another entry "
                                "for the same layer")
            continue
        pinned.append((i, j))
    graph_pairs, done_s, done_d = _structural(src, dst, pinned, dropped, problems)
    known = _graph(src) is not None and _graph(dst) is not None
    free_s = [i for i in range(len(src)) if i not in dropped and i not in done_s
              and all(p[0] != i for p in pinned)]
    free_d = [j for j in range(len(dst)) if j not in done_d and all(p[1] != j for p in pinned)]
    auto = [(free_s[a], free_d[b]) for a, b in _lcs([src[i] for i in free_s], [dst[j] for j in free_d])]
    auto += _unique_leftovers(src, dst, set(free_s) - {p[0] for p in auto}, set(free_d) - {p[1] for p in auto})
    why = ("their neighbourhoods in the two graphs differ, so the structure cannot pair them" if known else
           f"the {'source' if _graph(src) is None else 'target'} model's structure is unknown (no "
           "functional graph or traced forward pass), so their order cannot be trusted")
    kept, bad = _unsafe(src, dst, auto, free_s, free_d, problems, why)
    refused_s = {i for i in free_s if (src[i].kind, src[i].main_size) in bad}
    refused_d = {j for j in free_d if (dst[j].kind, dst[j].main_size) in bad}
    pairs = sorted(pinned + graph_pairs + kept, key=lambda p: p[1])
    taken_s = {p[0] for p in pairs} | dropped | (done_s - {p[0] for p in graph_pairs}) | refused_s
    taken_d = {p[1] for p in pairs} | (done_d - {p[1] for p in graph_pairs}) | refused_d
    for i, u in enumerate(src):
        if i not in taken_s:
            problems.extend(f"source {n} {_shape(u, r)}: its {u.label} has no counterpart in the target"
                            for r, n in u.params.items())
    for j, u in enumerate(dst):
        if j not in taken_d:
            problems.extend(f"target {n} {_shape(u, r)}: nothing in the source corresponds to its "
                            f"{u.label}" for r, n in u.params.items())
    return [(src[i], dst[j]) for i, j in pairs]


def _shape(u: Unit, role: str) -> str:
    return f"{list(u.shapes[role])}"


def plan_moves(pairs: list[tuple[Unit, Unit]], problems: list[str]) -> list[Move]:
    """Every target array's :class:`Move`, checking shapes on zero-filled stand-ins."""
    import numpy as np

    moves: list[Move] = []
    for s, d in pairs:
        try:
            unit_moves = plan_unit(s, d)
        except LayoutProblem as e:
            problems.extend(f"source {n} -> {d.label}: {e}" for n in s.params.values())
            continue
        shapes = {n: s.shapes[r] for r, n in s.params.items()}
        want = {n: d.shapes[r] for r, n in d.params.items()}
        ok = True
        for mv in unit_moves:
            try:
                got = mv.weight([np.zeros(shapes[x], np.float32) for x in mv.src]).shape
            except (ValueError, IndexError, LayoutProblem) as e:
                got, err = None, str(e)
            else:
                err = ""
            if got != want[mv.dst]:
                ok = False
                what = f"gives shape {list(got)}" if got is not None else f"fails ({err})"
                problems.append(f"source {', '.join(mv.src)} {[list(shapes[x]) for x in mv.src]} -> target "
                                f"{mv.dst}: the layout transform ({mv.note or 'identity'}) {what} but the "
                                f"target's shape is {list(want[mv.dst])}")
        if ok:
            moves.extend(unit_moves)
    return moves

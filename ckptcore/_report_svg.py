"""The plots of ``ckpt report``'s page, drawn as inline SVG text: lines over a numeric axis
(metrics against steps), bars per step (save seconds, bytes) and lanes over time (the steps each
tier holds).

No script and no external resource: the page must render from the file alone, and under a
Content-Security-Policy that allows no script.  Every string that reaches the SVG (labels,
tooltips) goes through :func:`esc`, since most of them come from checkpoints (untrusted).  Each
plot is an ``<svg class="plot">`` whose data marks carry ``class="pt"`` (what the page's
browser test counts) and a ``<title>`` (the browser's tooltip: the exact figures).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

__all__ = ["esc", "Series", "Mark", "line_plot", "bar_plot", "timeline", "PALETTE", "nice_ticks",
           "span"]

# Okabe-Ito: told apart with the common colour-vision deficiencies.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
_W, _H = 1080, 240  # a plot's size in CSS pixels
_L, _R, _T, _B = 70, 16, 14, 34  # margins: room for the axes' labels
_AXIS, _GRID, _FLAG = "#555", "#e4e4e4", "#c00000"


def esc(value: Any) -> str:
    """``value`` as text safe inside an HTML or SVG element or a quoted attribute."""
    return html.escape(str(value), quote=True)


@dataclass
class Series:
    """One line: ``points`` of ``(x, y, tooltip)``; a y that is not finite is drawn as a red
    cross on the top edge (a NaN loss must show, not vanish)."""

    label: str
    color: str
    points: list[tuple[float, float, str]] = field(default_factory=list)


@dataclass
class Mark:
    """A vertical line at ``x`` (a resume), labelled; ``flagged`` draws it red."""

    x: float
    label: str
    flagged: bool = False
    tooltip: str = ""


def nice_ticks(lo: float, hi: float, count: int = 5, whole: bool = False) -> list[float]:
    """Round tick values covering ``lo..hi`` (steps of 1, 2 or 5 times a power of ten; at
    least 1 when ``whole``: step numbers)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = max((hi - lo) / max(count, 1), 1.0 if whole else 0.0)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def span(values: Sequence[float], zero: bool = False,
         flat: float | None = None) -> tuple[float, float]:
    """The axis range of ``values`` (the finite ones), with 4% to spare on each side (none below
    a ``zero`` floor); ``flat``: the half-width when every value is equal (default: a tenth of
    the value), e.g. 30 seconds for one instant."""
    finite = [v for v in values if math.isfinite(v)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if zero:
        lo = min(lo, 0.0)
    if hi - lo < 1e-12 * max(1.0, abs(hi)):
        pad = flat if flat is not None else (abs(hi) * 0.1 or 1.0)
        return lo - pad, hi + pad
    extra = (hi - lo) * 0.04
    return (lo if zero and lo == 0.0 else lo - extra), hi + extra


class _Frame:
    """The mapping of data to pixels of one plot, and its axes."""

    def __init__(self, xs: tuple[float, float], ys: tuple[float, float], height: int = _H):
        self.x0, self.x1 = xs
        self.y0, self.y1 = ys
        self.h = height

    def x(self, v: float) -> float:
        return _L + (v - self.x0) / (self.x1 - self.x0) * (_W - _L - _R)

    def y(self, v: float) -> float:
        return self.h - _B - (v - self.y0) / (self.y1 - self.y0) * (self.h - _T - _B)

    def axes(self, x_fmt: Callable[[float], str], y_fmt: Callable[[float], str] | None,
             x_ticks: Sequence[float] | None = None) -> list[str]:
        out = []
        if y_fmt is not None:
            for t in nice_ticks(self.y0, self.y1):
                y = self.y(t)
                out.append(f'<line x1="{_L}" x2="{_W - _R}" y1="{y:.1f}" y2="{y:.1f}" '
                           f'stroke="{_GRID}"/><text x="{_L - 6}" y="{y + 4:.1f}" '
                           f'text-anchor="end">{esc(y_fmt(t))}</text>')
        for t in (x_ticks if x_ticks is not None else nice_ticks(self.x0, self.x1, 8)):
            x = self.x(t)
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{self.h - _B}" '
                       f'y2="{self.h - _B + 4}" stroke="{_AXIS}"/><text x="{x:.1f}" '
                       f'y="{self.h - _B + 17}" text-anchor="middle">{esc(x_fmt(t))}</text>')
        out.append(f'<line x1="{_L}" x2="{_W - _R}" y1="{self.h - _B}" y2="{self.h - _B}" '
                   f'stroke="{_AXIS}"/><line x1="{_L}" x2="{_L}" y1="{_T}" y2="{self.h - _B}" '
                   f'stroke="{_AXIS}"/>')
        return out

    def marks(self, marks: Sequence[Mark]) -> list[str]:
        out = []
        for m in marks:
            if not math.isfinite(m.x):
                continue
            x = self.x(min(max(m.x, self.x0), self.x1))
            color = _FLAG if m.flagged else "#777"
            out.append(f'<g class="mark"><title>{esc(m.tooltip or m.label)}</title>'
                       f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_T}" y2="{self.h - _B}" '
                       f'stroke="{color}" stroke-width="1.5" stroke-dasharray="5 3"/>'
                       + (f'<text x="{x + 3:.1f}" y="{_T + 10}" fill="{color}">'
                          if x < _W - _R - 70 else  # near the right edge: the label on the left
                          f'<text x="{x - 3:.1f}" y="{_T + 10}" fill="{color}" text-anchor="end">')
                       + f'{esc(m.label)}</text>'
                       '</g>')
        return out


def _svg(title: str, body: list[str], points: int, height: int = _H) -> str:
    return (f'<svg class="plot" data-points="{points}" width="{_W}" height="{height}" '
            f'viewBox="0 0 {_W} {height}" role="img" aria-label="{esc(title)}" '
            f'xmlns="http://www.w3.org/2000/svg">' + "".join(body) + "</svg>")


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def line_plot(title: str, series: Sequence[Series], marks: Sequence[Mark] = (),
              x_fmt: Callable[[float], str] = _fmt, y_fmt: Callable[[float], str] = _fmt) -> str:
    """Lines of ``series`` over a shared numeric x axis, ``marks`` as vertical lines."""
    xs = [p[0] for s in series for p in s.points] + [m.x for m in marks]
    frame = _Frame(span(xs), span([p[1] for s in series for p in s.points]))
    whole = all(float(x).is_integer() for x in xs if math.isfinite(x))  # steps: no 2.5
    body = frame.axes(x_fmt, y_fmt, nice_ticks(frame.x0, frame.x1, 8, whole)) + frame.marks(marks)
    n = 0
    for s in series:
        finite = [p for p in s.points if math.isfinite(p[1])]
        if len(finite) > 1:
            path = " ".join(f"{frame.x(x):.1f},{frame.y(y):.1f}" for x, y, _ in finite)
            body.append(f'<polyline points="{path}" fill="none" stroke="{s.color}" '
                        f'stroke-width="2"/>')
        for x, y, tip in s.points:
            n += 1
            px = frame.x(x)
            if math.isfinite(y):
                body.append(f'<circle class="pt" cx="{px:.1f}" cy="{frame.y(y):.1f}" r="3.5" '
                            f'fill="{s.color}"><title>{esc(tip)}</title></circle>')
            else:  # NaN or infinite: a cross at the top, in red
                body.append(f'<path class="pt" d="M{px - 5:.1f},{_T}l10,10m0,-10l-10,10" '
                            f'stroke="{_FLAG}" stroke-width="2.5"><title>{esc(tip)}</title></path>')
    return _svg(title, body, n)


def bar_plot(title: str, steps: Sequence[int], layers: Sequence[tuple[str, Sequence[Any]]],
             marks: Sequence[Mark] = (), y_fmt: Callable[[float], str] = _fmt,
             tips: Sequence[str] | None = None) -> str:
    """Bars per step: ``layers`` of ``(color, values)`` drawn over one another, each narrower
    than the one behind it (a save's seconds, and inside them the seconds it blocked); a value
    of None draws nothing (not recorded).  ``marks``' x are positions in ``steps``."""
    frame = _Frame((-0.5, len(steps) - 0.5),
                   span([float(v) for _, vals in layers for v in vals if v is not None], True))
    ticks = list(range(len(steps)))
    if len(ticks) > 16:  # label every k-th step only
        k = math.ceil(len(ticks) / 16)
        ticks = ticks[::k]
    body = frame.axes(lambda i: str(steps[int(i)]), y_fmt, ticks)
    slot = (_W - _L - _R) / max(len(steps), 1)
    n = 0
    for depth, (color, values) in enumerate(layers):
        width = slot * 0.8 * (0.55 ** depth)
        for i, v in enumerate(values):
            if v is None:
                continue
            n += 1
            top, base = frame.y(max(float(v), 0.0)), frame.y(0.0)
            tip = tips[i] if tips is not None else f"step {steps[i]}: {y_fmt(float(v))}"
            body.append(f'<rect class="pt" x="{frame.x(i) - width / 2:.1f}" y="{top:.1f}" '
                        f'width="{width:.1f}" height="{max(base - top, 1.0):.1f}" '
                        f'fill="{color}"><title>{esc(tip)}</title></rect>')
    return _svg(title, body + frame.marks(marks), n)  # (over the bars: their labels show)


def timeline(title: str, lanes: Sequence[tuple[str, list[tuple[float, str, str]]]],
             marks: Sequence[Mark] = (),
             t_fmt: Callable[[tuple[float, float]], Callable[[float], str]] | None = None) -> str:
    """One lane per tier over time: ``(label, [(time, color, tooltip), ...])``; ``t_fmt``
    gives the tick labels' format for the axis' range."""
    height = _T + _B + 34 * max(len(lanes), 1) + 10
    ts = [t for _, pts in lanes for t, _, _ in pts] + [m.x for m in marks]
    frame = _Frame(span(ts, flat=30.0), (0.0, float(max(len(lanes), 1))), height)
    body = frame.axes(t_fmt((frame.x0, frame.x1)) if t_fmt else _fmt, None) + frame.marks(marks)
    n = 0
    for i, (label, pts) in enumerate(lanes):
        y = frame.y(len(lanes) - i - 0.5)
        body.append(f'<line x1="{_L}" x2="{_W - _R}" y1="{y:.1f}" y2="{y:.1f}" stroke="{_GRID}"/>'
                    f'<text x="{_L - 6}" y="{y + 4:.1f}" text-anchor="end">'
                    f'{esc(_short(label, 10))}<title>{esc(label)}</title></text>')
        for t, color, tip in pts:
            n += 1
            body.append(f'<rect class="pt" x="{frame.x(t) - 3:.1f}" y="{y - 9:.1f}" width="6" '
                        f'height="18" fill="{color}"><title>{esc(tip)}</title></rect>')
    return _svg(title, body, n, height)


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else "…" + text[-(n - 1):]

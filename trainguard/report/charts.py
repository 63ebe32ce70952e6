"""Charts as inline SVG, drawn in Python: the report needs no script library, no CDN, no network.

A chart is a function of its data (lines of (x, y) points, event markers, threshold lines) that returns
an `<svg>` string; the page's small script only toggles series and marks charts as drawn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from typing import Sequence

PALETTE = ("#1c7ed6", "#e8590c", "#2f9e44", "#ae3ec9", "#f08c00", "#0c8599", "#c2255c", "#5c940d",
           "#3b5bdb", "#868e96", "#d6336c", "#099268", "#7048e8", "#e67700", "#1098ad", "#495057")
MARK_COLORS = {"checkpoint": "#2f9e44", "skip": "#f08c00", "rollback": "#e03131", "restore": "#1c7ed6",
               "alert": "#ae3ec9", "fault": "#343a40", "phase": "#fab005"}
MARK_NAMES = {"checkpoint": "checkpoint", "skip": "skipped step", "rollback": "rollback",
              "restore": "restore", "alert": "alert", "fault": "injected fault", "phase": "LR phase change"}

SPAN_COLORS = {"stall": "#e03131", "restart": "#1c7ed6", "gap": "#868e96"}
SPAN_NAMES = {"stall": "stalled (hung)", "restart": "restarting", "gap": "no records"}

WIDTH, HEIGHT = 760, 230
PAD_L, PAD_R, PAD_T, PAD_B = 64, 14, 16, 28
# A line is not drawn across a gap between two of its points wider than this many times its median gap:
# nothing was recorded there, and a straight line would invent data.
GAP_FACTOR = 5.0


@dataclass
class Line:
    label: str
    points: Sequence[tuple[float, float]]
    color: str | None = None
    dash: bool = False
    faded: bool = False          # a pass a rollback or restart discarded (drawn, but faint)
    group: int | None = None     # the legend key it belongs to (default: its own position)


@dataclass
class Span:
    """A stretch of the x axis with a meaning (stalled, restarting, no records): shaded; no line crosses it."""

    start: float
    end: float
    kind: str                    # stall | restart | gap
    label: str


@dataclass
class HLine:
    value: float
    label: str
    color: str = "#e03131"


@dataclass
class Mark:
    x: float
    kind: str
    label: str


# ------------------------------------------------------------------------------------------ numbers

def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high] (Heckbert's nice numbers)."""
    if high <= low:
        high = low + (abs(low) or 1.0)
    raw = (high - low) / max(1, count)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step - 1e-9) * step
    ticks, value = [], first
    while value <= high + step * 1e-9:
        ticks.append(0.0 if abs(value) < step * 1e-9 else value)
        value += step
    return ticks


# Steps a time axis ticks at: seconds, minutes, hours, days as people count them.
TIME_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400,
              172800, 604800)


def time_ticks(low: float, high: float, count: int = 8) -> list[float]:
    """Elapsed-time ticks on round durations (15s, 5m, 2h...) covering [low, high]."""
    span = max(high - low, 1e-9)
    step = next((s for s in TIME_STEPS if span / s <= count), TIME_STEPS[-1] * math.ceil(span / count / TIME_STEPS[-1]))
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) // step) + 1)]


def _si(value: float, suffixes=((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))) -> str:
    for scale, suffix in suffixes:
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    if value == 0:
        return "0"
    return f"{value:.3g}"


def format_value(value: float, unit: str = "") -> str:
    """A value in a unit people read: 1.5 GiB, 12 ms, 43%, $1.20."""
    if unit == "bytes":
        for scale, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(value) >= scale:
                return f"{value / scale:.3g} {suffix}"
        return f"{value:.0f} B"
    if unit == "bytes/s":
        return format_value(value, "bytes") + "/s"
    if unit == "s":
        if value == 0:
            return "0"
        if abs(value) < 1e-3:
            return f"{value * 1e6:.3g} µs"
        return f"{value * 1e3:.3g} ms" if abs(value) < 1 else f"{value:.3g} s"
    if unit == "ms":
        return f"{value:.3g} ms"
    if unit == "percent":
        return f"{value:.3g}%"
    if unit == "ratio":
        return f"{value * 100:.3g}%"
    if unit == "usd":
        if value != 0 and abs(value) < 1:
            return f"${value:.3g}"
        return f"${value:,.2f}" if abs(value) < 1e4 else f"${_si(value)}"
    if unit in ("°C", "W", "MHz"):
        return f"{value:.3g} {unit}"
    return _si(value) + (f" {unit}" if unit else "")


def format_elapsed(seconds: float) -> str:
    """12s, 4m30s, 3h05m, 2d04h: a duration at the precision people read one."""
    seconds = int(round(max(0.0, seconds)))
    if seconds < 120:
        return f"{seconds}s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m" + (f"{secs:02d}s" if secs else "")
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def event_detail(event: dict) -> str:
    """`key=value, ...` of an event's scalar fields (its type and step are shown on their own)."""
    shown = [(k, v) for k, v in event.items()
             if k not in ("type", "step") and v is not None and not isinstance(v, (dict, list))]
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown[:8])


# ------------------------------------------------------------------------------------------- charts

class _Frame:
    """Maps data to pixels for one chart (linear x; linear or log y)."""

    def __init__(self, x0: float, x1: float, y0: float, y1: float, log_y: bool):
        self.x0, self.x1 = x0, (x1 if x1 > x0 else x0 + 1.0)
        self.log_y = log_y
        self.y0, self.y1 = (math.log10(y0), math.log10(y1)) if log_y else (y0, y1)
        if self.y1 <= self.y0:
            self.y1 = self.y0 + 1.0

    def px(self, x: float) -> float:
        return PAD_L + (x - self.x0) / (self.x1 - self.x0) * (WIDTH - PAD_L - PAD_R)

    def py(self, y: float) -> float:
        v = math.log10(y) if self.log_y else y
        return HEIGHT - PAD_B - (v - self.y0) / (self.y1 - self.y0) * (HEIGHT - PAD_T - PAD_B)


def _y_limits(lines: Sequence[Line], hlines: Sequence[HLine], y_min: float | None,
              y_max: float | None) -> tuple[float, float, bool]:
    values = [y for line in lines for _, y in line.points] + [h.value for h in hlines]
    low, high = min(values), max(values)
    log_y = low > 0 and high / low > 50 and y_min is None
    if log_y:
        return low / 1.2, high * 1.2, True
    span = (high - low) or (abs(high) or 1.0)
    low, high = low - span * 0.05, high + span * 0.05
    if y_min is not None:
        low = y_min
    elif min(values) >= 0 and low < 0:
        low = 0.0
    if y_max is not None:
        high = max(y_max, max(values))
    return low, high, False


def _binary_scale(high: float) -> float:
    """The power of 1024 that byte ticks are counted in, so they fall on round GiB or MiB."""
    scale = 1.0
    while high / scale >= 1024 * 2:
        scale *= 1024
    return scale


def _axes(frame: _Frame, t0: float, unit: str, by_step: bool = False) -> list[str]:
    parts = []
    bottom, right = HEIGHT - PAD_B, WIDTH - PAD_R
    if frame.log_y:
        ticks = [10 ** e for e in range(math.floor(frame.y0), math.ceil(frame.y1) + 1)
                 if frame.y0 <= e <= frame.y1] or [10 ** frame.y0]
    else:
        scale = _binary_scale(frame.y1) if unit in ("bytes", "bytes/s") else 1.0
        ticks = [t * scale for t in nice_ticks(frame.y0 / scale, frame.y1 / scale)]
    for tick in ticks:
        y = frame.py(tick)
        parts.append(f'<line class="grid" x1="{PAD_L}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}"/>'
                     f'<text class="tick" x="{PAD_L - 6}" y="{y + 4:.1f}" text-anchor="end">'
                     f'{escape(format_value(tick, unit))}</text>')
    x_ticks = ([(t, f"{t:,.0f}") for t in nice_ticks(frame.x0, frame.x1, 8) if t == int(t)] if by_step else
               [(t + t0, format_elapsed(t)) for t in time_ticks(frame.x0 - t0, frame.x1 - t0)])
    for tick, text in x_ticks:
        x = frame.px(tick)
        if PAD_L - 0.5 <= x <= right + 0.5:
            parts.append(f'<line class="tickmark" x1="{x:.1f}" x2="{x:.1f}" y1="{bottom}" y2="{bottom + 4}"/>'
                         f'<text class="tick" x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">'
                         f'{text}</text>')
    parts.append(f'<line class="axis" x1="{PAD_L}" x2="{right}" y1="{bottom}" y2="{bottom}"/>'
                 f'<line class="axis" x1="{PAD_L}" x2="{PAD_L}" y1="{PAD_T}" y2="{bottom}"/>')
    return parts


def pieces(points: Sequence[tuple[float, float]], spans: Sequence[Span] = ()) -> list[list[tuple[float, float]]]:
    """The runs of a line that may be joined: cut where two neighbours are further apart than GAP_FACTOR
    times the line's median spacing, or jump over a whole span (nothing recorded in it)."""
    if len(points) < 2:
        return [list(points)]
    spacing = sorted(b[0] - a[0] for a, b in zip(points, points[1:]))
    limit = GAP_FACTOR * spacing[len(spacing) // 2] if spacing[len(spacing) // 2] > 0 else float("inf")
    out = [[points[0]]]
    for a, b in zip(points, points[1:]):
        jumps = any(a[0] <= span.start and b[0] >= span.end for span in spans)
        if b[0] - a[0] > limit or jumps:
            out.append([])
        out[-1].append(b)
    return out


def _path(frame: _Frame, points: Sequence[tuple[float, float]], spans: Sequence[Span] = ()) -> str:
    return "".join("M" + "L".join(f"{frame.px(x):.1f},{frame.py(y):.1f}" for x, y in piece)
                   for piece in pieces(points, spans))


def _spans(frame: _Frame, spans: Sequence[Span]) -> list[str]:
    parts = ['<g class="spans">']
    for span in spans:
        x0, x1 = max(frame.px(span.start), PAD_L), min(frame.px(span.end), WIDTH - PAD_R)
        if x1 <= x0:
            continue
        parts.append(f'<rect class="span span-{span.kind}" x="{x0:.1f}" y="{PAD_T}" width="{max(x1 - x0, 1.0):.1f}"'
                     f' height="{HEIGHT - PAD_T - PAD_B}" fill="{SPAN_COLORS.get(span.kind, "#868e96")}"'
                     f' data-start="{span.start:.3f}" data-end="{span.end:.3f}"><title>{escape(span.label)}</title></rect>')
    parts.append("</g>")
    return parts


def _marks(frame: _Frame, marks: Sequence[Mark]) -> list[str]:
    parts = ['<g class="marks">']
    for mark in marks:
        x = frame.px(mark.x)
        color = MARK_COLORS.get(mark.kind, "#495057")
        parts.append(f'<g class="mark mark-{mark.kind}"><title>{escape(mark.label)}</title>'
                     f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{PAD_T}" y2="{HEIGHT - PAD_B}" stroke="{color}"/>'
                     f'<circle cx="{x:.1f}" cy="{PAD_T + 3}" r="3.5" fill="{color}"/></g>')
    parts.append("</g>")
    return parts


def line_chart(lines: Sequence[Line], *, t0: float, unit: str = "", marks: Sequence[Mark] = (),
               hlines: Sequence[HLine] = (), y_min: float | None = None, y_max: float | None = None,
               x_range: tuple[float, float] | None = None, spans: Sequence[Span] = (),
               by_step: bool = False) -> str:
    """An SVG line chart over elapsed time since `t0` (or over steps, `by_step`); empty lines are left out.

    `spans` are shaded, and no line is drawn across one it has no point in."""
    lines = [line for line in lines if line.points]
    if not lines:
        raise ValueError("line_chart needs at least one line with points")
    xs = [x for line in lines for x in (line.points[0][0], line.points[-1][0])]
    x0, x1 = x_range or (min(xs), max(xs))
    y0, y1, log_y = _y_limits(lines, hlines, y_min, y_max)
    frame = _Frame(x0, x1, y0, y1, log_y)
    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" preserveAspectRatio="none"'
             f' data-points="{sum(len(line.points) for line in lines)}" data-log="{int(log_y)}"'
             f' data-axis="{"step" if by_step else "time"}" data-x0="{frame.x0:.3f}" data-x1="{frame.x1:.3f}">']
    parts += _spans(frame, [span for span in spans if span.end >= x0 and span.start <= x1])
    parts += _axes(frame, t0, unit, by_step)
    right_ys: list[float] = []
    for h in sorted(hlines, key=lambda h: -h.value):
        y = frame.py(h.value)
        # Labels sit above their line at the right; one too close to the last goes to the left end instead.
        crowded = any(abs(y - other) < 14 for other in right_ys)
        x, anchor = (PAD_L + 4, "start") if crowded else (WIDTH - PAD_R - 4, "end")
        if not crowded:
            right_ys.append(y)
        parts.append(f'<g class="hline"><title>{escape(h.label)}</title><line x1="{PAD_L}" x2="{WIDTH - PAD_R}"'
                     f' y1="{y:.1f}" y2="{y:.1f}" stroke="{h.color}"/><text x="{x}" y="{y - 4:.1f}"'
                     f' text-anchor="{anchor}" fill="{h.color}">{escape(h.label)}</text></g>')
    parts += _marks(frame, [m for m in marks if x0 <= m.x <= x1])
    for i, (line, color) in enumerate(zip(lines, line_colors(lines))):
        group = i if line.group is None else line.group
        dash = ' stroke-dasharray="5 3"' if line.dash or line.faded else ""
        faded = " faded" if line.faded else ""
        parts.append(f'<path class="series{faded}" data-series="{group}" d="{_path(frame, line.points, spans)}"'
                     f' stroke="{color}"{dash}><title>{escape(line.label)}</title></path>')
        if len(line.points) == 1:
            x, y = line.points[0]
            parts.append(f'<circle class="series{faded}" data-series="{group}" cx="{frame.px(x):.1f}"'
                         f' cy="{frame.py(y):.1f}" r="3" fill="{color}"/>')
    if log_y:
        parts.append(f'<text class="note" x="{PAD_L + 4}" y="{PAD_T + 12}">log scale</text>')
    parts.append("</svg>")
    return "".join(parts)


def line_colors(lines: Sequence[Line]) -> list[str]:
    kept = [line for line in lines if line.points]
    return [line.color or PALETTE[(i if line.group is None else line.group) % len(PALETTE)]
            for i, line in enumerate(kept)]


def share_bar(parts: Sequence[tuple[str, float, str]], unit: str = "s") -> str:
    """One horizontal stacked bar of (label, value, color), labelled with each part's share."""
    total = sum(max(0.0, v) for _, v, _ in parts)
    if total <= 0:
        raise ValueError("share_bar needs a positive total")
    height, bar_top, bar_h = 64, 6, 30
    out = [f'<svg class="chart bar" viewBox="0 0 {WIDTH} {height}" role="img" data-points="{len(parts)}">']
    x = 0.0
    for label, value, color in parts:
        width = max(0.0, value) / total * WIDTH
        if width <= 0:
            continue
        share = value / total
        out.append(f'<rect class="series" x="{x:.1f}" y="{bar_top}" width="{width:.1f}" height="{bar_h}"'
                   f' fill="{color}"><title>{escape(label)}: {escape(format_value(value, unit))}'
                   f' ({share:.1%})</title></rect>')
        if width > 70:
            out.append(f'<text x="{x + 6:.1f}" y="{bar_top + 20}" class="barlabel">{escape(label)}'
                       f' {share:.0%}</text>')
        x += width
    out.append("</svg>")
    return "".join(out)


# Why a run has no MFU when it recorded none and said no reason (a library loop, an older trainer): MFU is
# written only where the device's peak is documented or given (runtime/mfu.py), never estimated.
MFU_UNKNOWN = "no documented peak FLOPs for the device, or no model FLOPs per token"


def mfu_na(reason: str = "") -> str:
    return f"n/a ({reason or MFU_UNKNOWN})"

"""Line charts drawn on the server as SVG: pure functions of the points, testable without a
browser, styled by ui.css through classes (the page's CSP forbids inline styles).

A chart is accessible: ``role="img"`` named by its ``<title>`` and described by its
``<desc>``, with labelled axes. Each series is one ``<polyline>`` (class ``series-N``);
with ``log_y`` the y axis is log10 and points at or below zero are left out. The key is
HTML (``legend``), so that it reflows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

WIDTH, HEIGHT = 720, 300
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 64, 16, 16, 44
MAX_POINTS = 500  # per series: more adds nothing a screen can show


@dataclass(frozen=True)
class Series:
    name: str
    points: Sequence[tuple[float, float]]  # (x, y), x ascending


def thin(points: Sequence[tuple[float, float]], most: int) -> list[tuple[float, float]]:
    """At most ``most`` of ``points``, evenly spaced, the first and the last kept."""
    if len(points) <= most:
        return list(points)
    step = (len(points) - 1) / (most - 1)
    return [points[round(i * step)] for i in range(most)]


def nice_ticks(low: float, high: float, count: int = 6) -> list[float]:
    """About ``count`` round values from ``low`` to ``high`` (1, 2, 2.5 or 5 times a power
    of ten apart)."""
    if high <= low:
        return [low]
    raw = (high - low) / max(1, count - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    return ticks


def log_ticks(low: float, high: float) -> list[float]:
    """Tick positions (log10 of the values) between ``low`` and ``high`` (log10 too) at
    round values: 1, 2 and 5 times powers of ten, only the powers when those are many."""
    values = [
        m * 10.0**k
        for k in range(math.floor(low) - 1, math.ceil(high) + 1)
        for m in (1, 2, 5)
        if low - 1e-9 <= math.log10(m * 10.0**k) <= high + 1e-9
    ]
    if len(values) > 8:
        values = [v for v in values if math.isclose(10 ** round(math.log10(v)), v)]
    if len(values) < 2:
        return nice_ticks(low, high)
    return [math.log10(v) for v in values]


def _label(value: float) -> str:
    return f"{value:.3g}"


def line_chart(
    series: Sequence[Series],
    *,
    title: str,
    desc: str,
    chart_id: str = "chart",
    x_label: str = "step",
    y_label: str = "loss",
    log_y: bool = False,
    width: int = WIDTH,
    height: int = HEIGHT,
    max_points: int = MAX_POINTS,
) -> Markup:
    """The SVG of ``series`` on shared axes."""
    drawn = []
    for s in series:
        pts = [(x, y) for x, y in s.points if math.isfinite(x) and math.isfinite(y)]
        if log_y:
            pts = [(x, math.log10(y)) for x, y in pts if y > 0]
        drawn.append((s.name, thin(pts, max_points)))
    everything = [p for _, pts in drawn for p in pts]
    plot_w = width - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = height - MARGIN_TOP - MARGIN_BOTTOM
    title_id, desc_id = f"{chart_id}-title", f"{chart_id}-desc"
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {width} {height}" '
        f'role="img" aria-labelledby="{title_id} {desc_id}" id="{escape(chart_id)}">',
        f'<title id="{title_id}">{escape(title)}</title>',
        f'<desc id="{desc_id}">{escape(desc)}</desc>',
    ]
    if not everything:
        out.append(
            f'<text class="chart-empty" x="{width / 2:.0f}" y="{height / 2:.0f}" '
            'text-anchor="middle">No points yet</text></svg>'
        )
        return Markup("".join(out))
    x0, x1 = min(p[0] for p in everything), max(p[0] for p in everything)
    y0, y1 = min(p[1] for p in everything), max(p[1] for p in everything)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        pad = abs(y0) * 0.1 or 1.0
        y0, y1 = y0 - pad, y1 + pad

    def sx(x: float) -> float:
        return MARGIN_LEFT + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return MARGIN_TOP + (1 - (y - y0) / (y1 - y0)) * plot_h

    bottom, right = MARGIN_TOP + plot_h, MARGIN_LEFT + plot_w
    out.append(
        f'<g class="axes"><line x1="{MARGIN_LEFT}" y1="{bottom}" x2="{right}" y2="{bottom}"/>'
    )
    out.append(f'<line x1="{MARGIN_LEFT}" y1="{MARGIN_TOP}" x2="{MARGIN_LEFT}" y2="{bottom}"/></g>')
    out.append('<g class="ticks">')
    for t in nice_ticks(x0, x1):
        out.append(
            f'<text x="{sx(t):.1f}" y="{bottom + 16}" text-anchor="middle">{_label(t)}</text>'
        )
    for t in log_ticks(y0, y1) if log_y else nice_ticks(y0, y1):
        shown = _label(10**t) if log_y else _label(t)
        at = f"{sy(t):.1f}"
        out.append(f'<line class="grid" x1="{MARGIN_LEFT}" y1="{at}" x2="{right}" y2="{at}"/>')
        out.append(
            f'<text x="{MARGIN_LEFT - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{shown}</text>'
        )
    out.append("</g>")
    out.append(
        f'<text class="axis-label" x="{MARGIN_LEFT + plot_w / 2:.0f}" y="{height - 6}" '
        f'text-anchor="middle">{escape(x_label)}</text>'
    )
    scale = " (log scale)" if log_y else ""
    out.append(
        f'<text class="axis-label" x="14" y="{MARGIN_TOP + plot_h / 2:.0f}" text-anchor="middle" '
        f'transform="rotate(-90 14 {MARGIN_TOP + plot_h / 2:.0f})">{escape(y_label + scale)}</text>'
    )
    for i, (name, pts) in enumerate(drawn):
        if not pts:
            continue
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        out.append(
            f'<polyline class="series series-{i % 6}" data-series="{escape(name)}" '
            f'fill="none" points="{coords}"><title>{escape(name)}</title></polyline>'
        )
    out.append("</svg>")
    return Markup("".join(out))


def legend(series: Sequence[Series]) -> Markup:
    """The chart's key, as HTML beside it (it reflows on a phone, where text inside the
    scaled-down SVG would not): a colour swatch and the name of each series."""
    items = "".join(
        f'<li><span class="swatch series-{i % 6}" aria-hidden="true"></span>{escape(s.name)}</li>'
        for i, s in enumerate(series)
    )
    return Markup(f'<ul class="legend">{items}</ul>')


# The parts of a memory plan, in the order they are stacked (planner.Breakdown's names).
MEMORY_PARTS = ("weights", "gradients", "optimizer", "activations", "logits")


def _bytes_label(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def memory_chart(
    rows: Sequence[tuple[str, dict[str, float]]],
    *,
    device_bytes: float,
    budget_bytes: float,
    title: str,
    desc: str,
    chart_id: str = "memory",
    width: int = WIDTH,
) -> Markup:
    """Horizontal bars, one per (label, breakdown) row, each stacking ``MEMORY_PARTS``
    (class ``part-NAME``), against the device's memory and the planner's budget (dashed
    lines). Every segment has a ``<title>`` with its size, for hover and screen readers."""
    label_w, bar_h, gap, top, bottom = 190, 26, 14, 12, 48
    height = top + len(rows) * (bar_h + gap) + bottom
    plot_w = width - label_w - MARGIN_RIGHT - 8
    most = max([device_bytes, *(sum(b.get(p, 0) for p in MEMORY_PARTS) for _, b in rows)])
    scale = plot_w / most if most > 0 else 0.0
    title_id, desc_id = f"{chart_id}-title", f"{chart_id}-desc"
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart memory" '
        f'viewBox="0 0 {width} {height}" role="img" aria-labelledby="{title_id} {desc_id}" '
        f'id="{escape(chart_id)}">',
        f'<title id="{title_id}">{escape(title)}</title>',
        f'<desc id="{desc_id}">{escape(desc)}</desc>',
    ]
    for i, (label, parts) in enumerate(rows):
        y = top + i * (bar_h + gap)
        out.append(
            f'<text x="{label_w - 8}" y="{y + bar_h / 2 + 4:.0f}" '
            f'text-anchor="end">{escape(label)}</text>'
        )
        x = float(label_w)
        for part in MEMORY_PARTS:
            size = parts.get(part, 0)
            if size <= 0:
                continue
            w = size * scale
            out.append(
                f'<rect class="part part-{part}" x="{x:.1f}" y="{y}" width="{w:.1f}" '
                f'height="{bar_h}"><title>{escape(label)}: {part} '
                f"{_bytes_label(size)}</title></rect>"
            )
            x += w
        total = sum(parts.get(p, 0) for p in MEMORY_PARTS)
        inside = x + 70 > label_w + plot_w
        out.append(
            f'<text class="bar-total" x="{x - 4 if inside else x + 4:.1f}" '
            f'y="{y + bar_h / 2 + 4:.0f}" text-anchor="{"end" if inside else "start"}">'
            f"{_bytes_label(total)}</text>"
        )
    base = top + len(rows) * (bar_h + gap)
    for cls, value, name in (
        ("budget", budget_bytes, "budget"),
        ("device", device_bytes, "device"),
    ):
        x = label_w + value * scale
        out.append(
            f'<line class="limit limit-{cls}" x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" '
            f'y2="{base - gap + 4}"><title>{name} {_bytes_label(value)}</title></line>'
        )
        out.append(
            f'<text class="limit-label" x="{x:.1f}" y="{base + (16 if cls == "budget" else 36)}" '
            f'text-anchor="{"end" if x > width / 2 else "start"}">'
            f"{name} {_bytes_label(value)}</text>"
        )
    out.append("</svg>")
    return Markup("".join(out))


def memory_legend() -> Markup:
    """The key of ``memory_chart``, as HTML."""
    items = "".join(
        f'<li><span class="swatch part-{p}" aria-hidden="true"></span>{p}</li>'
        for p in MEMORY_PARTS
    )
    return Markup(f'<ul class="legend">{items}</ul>')

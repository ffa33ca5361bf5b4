"""A dependency-free SVG line chart: the attainment-vs-rate plot of `kvrelay plan --plot`.

`kvrelay plan` must draw its plot where matplotlib is not installed, so this writes the few SVG
elements a line chart needs: a log-scaled x axis (request rate), a linear y axis (share of
requests within both SLOs, 0..1), one polyline with markers per series, a dotted target line
and a legend. Everything is plain text, so tests can check the numbers that went in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape

# Tableau-like colours, cycled over the series.
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
          "#bcbd22", "#17becf")
WIDTH, HEIGHT = 720, 420
LEFT, RIGHT, TOP, BOTTOM = 64, 170, 36, 52  # margins around the plot area, px
Scale = Callable[[float], float]  # data value -> pixel


@dataclass(frozen=True)
class Series:
    label: str
    points: Sequence[tuple[float, float]]  # (x > 0, y in [0, 1])


def _log_range(xs: Sequence[float]) -> tuple[float, float]:
    lo, hi = math.log10(min(xs)), math.log10(max(xs))
    if hi - lo < 1e-9:  # one rate only: a decade around it
        lo, hi = lo - 0.5, hi + 0.5
    pad = (hi - lo) * 0.04
    return lo - pad, hi + pad


def _x_ticks(lo: float, hi: float) -> list[float]:
    """Rates at 1, 2 and 5 times the powers of ten inside [10**lo, 10**hi]."""
    ticks = [m * 10.0**e for e in range(math.floor(lo), math.ceil(hi) + 1) for m in (1, 2, 5)]
    inside = [t for t in ticks if lo <= math.log10(t) <= hi]
    return inside if len(inside) <= 9 else [t for t in inside if str(t).lstrip("0.").startswith("1")]


def _fmt(value: float) -> str:
    return f"{value:g}"


def line_chart_svg(series: Sequence[Series], title: str, x_label: str, y_label: str,
                   target_y: float | None = None) -> str:
    """The chart as an SVG document; x on a log scale, y from 0 to 1."""
    xs = [x for s in series for x, _ in s.points if x > 0]
    if not xs:
        raise ValueError("nothing to plot: no series has a point with a rate > 0")
    lo, hi = _log_range(xs)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (math.log10(x) - lo) / (hi - lo) * plot_w

    def py(y: float) -> float:
        return TOP + (1.0 - min(1.0, max(0.0, y))) * plot_h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="11">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{LEFT + plot_w / 2:.1f}" y="20" text-anchor="middle" font-size="13">'
           f'{escape(title)}</text>']
    out += _axes(px, py, lo, hi, plot_w, plot_h, x_label, y_label)
    if target_y is not None:
        out.append(f'<line x1="{LEFT}" y1="{py(target_y):.1f}" x2="{LEFT + plot_w}" y2="{py(target_y):.1f}" '
                   'stroke="grey" stroke-dasharray="3,3"/>')
    for i, s in enumerate(series):
        out += _series(s, COLORS[i % len(COLORS)], px, py, i)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _axes(px: Scale, py: Scale, lo: float, hi: float, plot_w: int, plot_h: int, x_label: str,
          y_label: str) -> list[str]:
    out = [f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="black"/>']
    for y in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0):
        out.append(f'<line x1="{LEFT}" y1="{py(y):.1f}" x2="{LEFT + plot_w}" y2="{py(y):.1f}" '
                   'stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{_fmt(y)}</text>')
    for x in _x_ticks(lo, hi):
        out.append(f'<line x1="{px(x):.1f}" y1="{TOP}" x2="{px(x):.1f}" y2="{TOP + plot_h}" stroke="#eee"/>')
        out.append(f'<text x="{px(x):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">{_fmt(x)}</text>')
    out.append(f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 12}" text-anchor="middle">'
               f'{escape(x_label)}</text>')
    out.append(f'<text x="16" y="{TOP + plot_h / 2:.1f}" text-anchor="middle" '
               f'transform="rotate(-90 16 {TOP + plot_h / 2:.1f})">{escape(y_label)}</text>')
    return out


def _series(s: Series, color: str, px: Scale, py: Scale, index: int) -> list[str]:
    points = sorted((x, y) for x, y in s.points if x > 0)
    coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
    out = [f'<g class="series" data-label="{escape(s.label)}">',
           f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.5"/>']
    out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{color}">'
            f'<title>{escape(s.label)}: {_fmt(x)} req/s, {y:.0%}</title></circle>' for x, y in points]
    legend_x, legend_y = WIDTH - RIGHT + 14, TOP + 10 + 16 * index
    out.append(f'<line x1="{legend_x}" y1="{legend_y}" x2="{legend_x + 18}" y2="{legend_y}" '
               f'stroke="{color}" stroke-width="2"/>')
    out.append(f'<text x="{legend_x + 24}" y="{legend_y + 4}">{escape(s.label)}</text>')
    out.append("</g>")
    return out

"""The dependency-free SVG chart behind `kvrelay plan --plot FILE.svg`."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from kvrelay.disagg.planner.svgplot import BOTTOM, HEIGHT, TOP, Series, line_chart_svg

NS = {"s": "http://www.w3.org/2000/svg"}


def polyline_points(svg: str) -> dict[str, list[tuple[float, float]]]:
    root = ET.fromstring(svg)
    out = {}
    for group in root.iterfind("s:g", NS):
        line = group.find("s:polyline", NS)
        assert line is not None
        coords = line.attrib["points"].split()
        out[group.attrib["data-label"]] = [tuple(map(float, p.split(","))) for p in coords]
    return out  # type: ignore[return-value]


def test_one_polyline_per_series_in_rate_order_with_a_legend() -> None:
    svg = line_chart_svg([Series("1x colocated", [(4.0, 0.5), (1.0, 1.0), (2.0, 0.9)]),
                          Series("1P1D", [(1.0, 0.95), (8.0, 0.1)])],
                         "title <&>", "rate", "share", target_y=0.9)
    lines = polyline_points(svg)
    assert list(lines) == ["1x colocated", "1P1D"]
    xs = [x for x, _ in lines["1x colocated"]]
    assert xs == sorted(xs)  # drawn left to right whatever order the points came in
    assert "title &lt;&amp;&gt;" in svg and svg.count("<circle") == 5


def test_axes_are_log_rate_and_linear_share() -> None:
    svg = line_chart_svg([Series("a", [(1.0, 1.0), (10.0, 0.0), (100.0, 0.5)])], "t", "x", "y")
    (a, b, c), = polyline_points(svg).values()
    assert a[1] == pytest.approx(TOP) and b[1] == pytest.approx(HEIGHT - BOTTOM)
    assert c[1] == pytest.approx((TOP + HEIGHT - BOTTOM) / 2)
    assert b[0] - a[0] == pytest.approx(c[0] - b[0], abs=0.2)  # each decade the same width
    assert a[0] < b[0] < c[0]


def test_a_single_rate_still_draws() -> None:
    svg = line_chart_svg([Series("a", [(0.5, 0.7)])], "t", "x", "y")
    assert svg.count("<circle") == 1


def test_nothing_to_plot_is_an_error() -> None:
    with pytest.raises(ValueError, match="nothing to plot"):
        line_chart_svg([Series("a", [])], "t", "x", "y")

"""Goodput search: determinism under a seed, bisection bounds, and the shapes it tries."""

from __future__ import annotations

import pytest

from kvrelay.disagg.planner.search import GoodputSearch, SearchOptions, cluster_shapes
from kvrelay.disagg.planner.sim import SLO, ClusterSpec
from kvrelay.disagg.planner.workload import Workload, synthetic_workload
from tests.disagg.planner.conftest import hand_profile


def search(seed: int, workload: Workload | None = None) -> GoodputSearch:
    workload = workload or synthetic_workload(60, 1.0, "50-300", "exp:20", seed=seed)
    return GoodputSearch(hand_profile(), workload, SLO(0.5, 0.02), search=SearchOptions(arrivals="poisson",
                                                                                        seed=seed))


def test_same_seed_same_answer_other_seed_other_arrivals() -> None:
    one = search(7).goodput(ClusterSpec(num_colocated=1))
    again = search(7).goodput(ClusterSpec(num_colocated=1))
    assert one.goodput == again.goodput and one.points == again.points
    assert synthetic_workload(60, 1.0, "50-300", "exp:20", seed=7) != \
        synthetic_workload(60, 1.0, "50-300", "exp:20", seed=8)


def test_bisection_brackets_the_goodput_within_the_tolerance() -> None:
    result = search(3).goodput(ClusterSpec(num_colocated=1))
    passed = [p.rate for p in result.points if p.passed]
    failed = [p.rate for p in result.points if not p.passed]
    assert result.goodput == max(passed)
    above = min(r for r in failed if r > result.goodput)
    assert above - result.goodput <= 0.05 * above


def test_more_instances_serve_more() -> None:
    s = search(1)
    assert s.goodput(ClusterSpec(num_colocated=2)).goodput > s.goodput(ClusterSpec(num_colocated=1)).goodput


def test_shapes_smallest_first() -> None:
    labels = [s.label for s in cluster_shapes(3)]
    assert labels == ["1x colocated", "2x colocated", "1P1D", "3x colocated", "1P2D", "2P1D"]
    with pytest.raises(ValueError, match="max-instances"):
        cluster_shapes(0)

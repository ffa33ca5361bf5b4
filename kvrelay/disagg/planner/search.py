"""Goodput search: the highest rate at which a cluster meets both SLOs, by bisection.

A rate passes when the SLO percentile of TTFT and of TPOT over the simulated requests are both
within their targets. The search doubles the rate until it fails, then bisects between the last
pass and the first failure down to a relative width `tolerance`. Goodput is assumed monotone in
the rate (more load never helps); the simulated points are kept for the attainment plot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.disagg.planner.profile import Profile
from kvrelay.disagg.planner.sim import SLO, Attainment, ClusterSpec, SimOptions, attainment, simulate
from kvrelay.disagg.planner.workload import Workload

MAX_HALVINGS = 6  # below 1/64 of the first guess a cluster is reported as meeting no rate


@dataclass(frozen=True)
class SearchOptions:
    arrivals: str = "scaled"  # how a workload is re-rated: 'scaled' timestamps or fresh 'poisson'
    seed: int = 0
    start_rate: float = 1.0  # per instance
    max_rate: float = 1000.0
    tolerance: float = 0.05  # relative width at which bisection stops

    def __post_init__(self) -> None:
        if not 0 < self.tolerance < 1:
            raise ValueError(f"--tolerance must be in (0, 1), got {self.tolerance}")
        if self.start_rate <= 0 or self.max_rate <= 0:
            raise ValueError(f"rates must be > 0, got start {self.start_rate}, max {self.max_rate}")


@dataclass
class Goodput:
    cluster: ClusterSpec
    goodput: float  # req/s; 0 when the lowest rate tried already fails
    gpus_per_instance: int
    points: list[Attainment] = field(default_factory=list)

    @property
    def per_instance(self) -> float:
        return self.goodput / self.cluster.num_instances

    @property
    def per_gpu(self) -> float:
        return self.per_instance / self.gpus_per_instance

    def point_at(self, rate: float) -> Attainment | None:
        return next((p for p in self.points if p.rate == rate), None)


class GoodputSearch:
    def __init__(self, profile: Profile, workload: Workload, slo: SLO, sim: SimOptions | None = None,
                 search: SearchOptions | None = None, pd_profile: Profile | None = None) -> None:
        self.profile, self.workload, self.slo = profile, workload, slo
        self.sim, self.search = sim or SimOptions(), search or SearchOptions()
        self.pd_profile = pd_profile

    def check(self, cluster: ClusterSpec, rate: float) -> Attainment:
        """Simulate the workload offered at `rate` req/s to `cluster`."""
        wl = self.workload.at_rate(rate, self.search.arrivals, self.search.seed)
        result = simulate(cluster, self.profile, wl, self.sim, self.pd_profile)
        point = attainment(result, self.slo, rate)
        point.extra.update(rejected=result.num_rejected, preemptions=result.num_preemptions,
                           hit_share=result.prefix_hit_tokens / max(1, result.prompt_tokens))
        return point

    def goodput(self, cluster: ClusterSpec) -> Goodput:
        prof = self.pd_profile if cluster.disaggregated and self.pd_profile else self.profile
        out = Goodput(cluster, 0.0, prof.gpus_per_instance)

        def passes(rate: float) -> bool:
            point = self.check(cluster, rate)
            out.points.append(point)
            return point.passed

        opts = self.search
        lo, hi = 0.0, min(opts.max_rate, opts.start_rate * cluster.num_instances)
        while passes(hi):
            lo = hi
            if hi >= opts.max_rate:
                out.goodput = hi
                return out
            hi = min(opts.max_rate, hi * 2)
        if lo == 0.0:  # the first guess failed: search downwards, at most 2**-MAX_HALVINGS of it
            floor = hi / 2**MAX_HALVINGS
            while hi > floor and not passes(hi / 2):
                hi /= 2
            if hi <= floor:
                out.points.sort(key=lambda p: p.rate)
                return out
            lo, hi = hi / 2, hi
        while hi - lo > opts.tolerance * hi:
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if passes(mid) else (lo, mid)
        out.goodput = lo
        out.points.sort(key=lambda p: p.rate)
        return out


def cluster_shapes(max_instances: int, colocated: bool = True,
                   disaggregated: bool = True) -> list[ClusterSpec]:
    """Colocated pools of 1..max and every xPyD with x + y <= max, smallest first."""
    if max_instances < 1:
        raise ValueError(f"--max-instances must be >= 1, got {max_instances}")
    shapes = []
    for total in range(1, max_instances + 1):
        if colocated:
            shapes.append(ClusterSpec(num_colocated=total))
        if disaggregated:
            shapes += [ClusterSpec(num_prefill=p, num_decode=total - p) for p in range(1, total)]
    return shapes


def smallest_meeting(search: GoodputSearch, shapes: list[ClusterSpec],
                     rate: float) -> dict[str, ClusterSpec | None]:
    """Per kind (colocated, disaggregated), the smallest cluster meeting the SLOs at `rate`."""
    found: dict[str, ClusterSpec | None] = {"colocated": None, "disaggregated": None}
    for shape in shapes:
        kind = "disaggregated" if shape.disaggregated else "colocated"
        if found[kind] is None and search.check(shape, rate).passed:
            found[kind] = shape
    return found

"""`kvrelay plan`: goodput per cluster shape, the recommended P:D split, instances needed.

Turns parsed options into a workload, profiles and a search, runs it and prints the report.
Kept apart from the argument parser (cli.py) so tests and scripts can call it with plain values.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvrelay.disagg.planner.distserve import DistServeConfig, DistServeSLO, distserve_goodput
from kvrelay.disagg.planner.profile import (
    Profile,
    distserve_coeffs,
    distserve_max_tokens,
    is_distserve_format,
)
from kvrelay.disagg.planner.search import Goodput, GoodputSearch, cluster_shapes, smallest_meeting
from kvrelay.disagg.planner.sim import SLO, ClusterSpec
from kvrelay.disagg.planner.svgplot import Series, line_chart_svg
from kvrelay.disagg.planner.workload import Workload


class PlanError(ValueError):
    """The plan has no answer for this input (e.g. no configuration meets the SLOs)."""


@dataclass
class PlanReport:
    slo: SLO
    target_rate: float
    results: list[Goodput]
    needed: dict[str, ClusterSpec | None] = field(default_factory=dict)
    rate_source: str = "--rate"  # where target_rate came from, as the report says it

    def best(self, disaggregated: bool) -> Goodput | None:
        pool = [g for g in self.results if g.cluster.disaggregated == disaggregated and g.goodput > 0]
        return max(pool, key=lambda g: (g.per_gpu, -g.cluster.num_instances), default=None)

    def to_json(self) -> dict[str, Any]:
        return {"slo": asdict(self.slo), "target_rate": self.target_rate,
                "target_rate_source": self.rate_source,
                "results": [{"cluster": g.cluster.label, "instances": g.cluster.num_instances,
                             "goodput": g.goodput, "per_instance": g.per_instance, "per_gpu": g.per_gpu,
                             "points": [asdict(p) for p in g.points]} for g in self.results],
                "needed": {k: (v.label if v else None) for k, v in self.needed.items()}}


def parse_shapes(text: str) -> list[ClusterSpec]:
    """'1,2,1P1D,2P1D': a number is that many colocated instances, xPyD a disaggregated cluster."""
    shapes = []
    for item in (t.strip().upper() for t in text.split(",") if t.strip()):
        try:
            if "P" in item and item.endswith("D"):
                p, d = item[:-1].split("P")
                shapes.append(ClusterSpec(num_prefill=int(p), num_decode=int(d)))
            else:
                shapes.append(ClusterSpec(num_colocated=int(item)))
        except ValueError:
            raise ValueError(f"cluster shape {item!r} is neither N (colocated instances) nor xPyD "
                             "(e.g. 2P1D), both >= 1") from None
    if not shapes:
        raise ValueError("--configs lists no cluster shape")
    return shapes


def run_plan(search: GoodputSearch, shapes: list[ClusterSpec], target_rate: float | None,
             needed_only: bool = False, rate_source: str | None = None) -> PlanReport:
    """Each shape's goodput, and the smallest shapes meeting the SLOs at `target_rate` (None: the
    workload's own rate); `rate_source` says where that rate came from."""
    rate = target_rate if target_rate is not None else search.workload.rate
    source = rate_source or ("--rate" if target_rate is not None else "the workload's own rate")
    if needed_only:
        if not math.isfinite(rate):
            raise ValueError("--needed-only needs a finite --rate (the workload has no spread of arrivals)")
        return PlanReport(search.slo, rate, [], smallest_meeting(search, shapes, rate), source)
    results = []
    for shape in shapes:  # a search takes seconds to minutes per shape: say where it is
        results.append(search.goodput(shape))
        print(f"plan: {shape.label}: goodput {results[-1].goodput:.3g} req/s "
              f"({len(results[-1].points)} simulated rates)", file=sys.stderr, flush=True)
    report = PlanReport(search.slo, rate, results, rate_source=source)
    if not any(g.goodput > 0 for g in results):
        raise PlanError(_unmeetable(search, results))
    if math.isfinite(rate):
        report.needed = smallest_meeting(search, shapes, rate)
    return report


def _unmeetable(search: GoodputSearch, results: list[Goodput]) -> str:
    slo = search.slo
    lowest = [min(g.points, key=lambda p: p.rate) for g in results if g.points]
    best_ttft = min(p.ttft_p_s for p in lowest)
    best_tpot = min(p.tpot_p_s for p in lowest)
    rejected = max(int(p.extra.get("rejected", 0)) for p in lowest)
    hint = (f"; {rejected} request(s) do not fit one instance (prompt over max_model_len or the KV cache)"
            if rejected else "")
    return (f"no configuration ({', '.join(g.cluster.label for g in results)}) meets p{slo.percentile:g} "
            f"TTFT <= {slo.ttft_s:g} s and TPOT <= {slo.tpot_s * 1e3:g} ms at any rate: at the lowest rate "
            f"tried the best p{slo.percentile:g} TTFT was {best_ttft:.3g} s and TPOT {best_tpot * 1e3:.3g} ms"
            f"{hint}. Relax the SLOs, allow more instances (--max-instances), or use a faster profile")


def print_report(report: PlanReport, header: str) -> None:
    slo = report.slo
    print(header)
    pct = f"p{slo.percentile:g}"
    print(f"SLO: {pct} TTFT <= {slo.ttft_s:g} s, {pct} TPOT <= {slo.tpot_s * 1e3:g} ms")
    if report.results:
        _print_goodputs(report)
    if report.needed:
        print(f"\nat {report.target_rate:.3g} req/s ({report.rate_source}):")
        for kind, shape in report.needed.items():
            answer = (f"{shape.label} ({shape.num_instances} instances)" if shape
                      else "more than the shapes tried")
            print(f"  {kind:14} needs {answer}")


def _print_goodputs(report: PlanReport) -> None:
    print(f"\n  {'config':16}{'instances':>10}{'goodput':>12}{'/instance':>11}{'/GPU':>9}"
          f"{'prefix hit':>12}")
    for g in report.results:
        at = max((p for p in g.points if p.passed), key=lambda p: p.rate, default=None)
        hit = f"{at.extra.get('hit_share', 0):.0%}" if at else "-"
        print(f"  {g.cluster.label:16}{g.cluster.num_instances:>10}{g.goodput:>12.3g}{g.per_instance:>11.3g}"
              f"{g.per_gpu:>9.3g}{hit:>12}")
    print("  (goodput: highest request rate, req/s, meeting both SLOs)")
    co, dis = report.best(False), report.best(True)
    if dis is not None:
        print(f"\nrecommended P:D split: {dis.cluster.num_prefill}:{dis.cluster.num_decode} "
              f"({dis.cluster.label}, {dis.per_instance:.3g} req/s per instance)")
    if co is not None and dis is not None:
        better = "disaggregated" if dis.per_instance > co.per_instance else "colocated"
        print(f"best per instance: colocated {co.per_instance:.3g} ({co.cluster.label}) vs disaggregated "
              f"{dis.per_instance:.3g} ({dis.cluster.label}): {better} serves more per instance")


def write_json(report: PlanReport, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report.to_json(), indent=1, default=str) + "\n")


PLOT_SUFFIXES = (".svg", ".png", ".pdf")
CURVE_POINTS = 8  # extra rates simulated per shape for the plot, log-spaced around its goodput


def check_plot_path(path: str) -> None:
    """Refuse a --plot file that cannot be written before the search runs (minutes), not after."""
    suffix = Path(path).suffix.lower()
    if suffix not in PLOT_SUFFIXES:
        raise ValueError(f"--plot {path}: the file must end in {', '.join(PLOT_SUFFIXES)} "
                         "(.svg needs no extra package)")
    if suffix != ".svg":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError(f"--plot {path} needs matplotlib, which is not installed: "
                             "pip install 'kvrelay[bench]', or write an SVG (--plot plan.svg)") from None


def fill_curves(search: GoodputSearch, report: PlanReport, num: int = CURVE_POINTS) -> None:
    """Add `num` log-spaced rates per shape, from a quarter of its goodput (or of the lowest rate
    tried) to twice it, so the plotted curve shows where attainment falls, not only the
    bisection's points."""
    for g in report.results:
        centre = g.goodput if g.goodput > 0 else min((p.rate for p in g.points), default=1.0)
        lo, hi = math.log(centre / 4), math.log(centre * 2)
        for k in range(num):
            rate = math.exp(lo + (hi - lo) * k / (num - 1))
            if all(abs(p.rate - rate) > 0.02 * rate for p in g.points):
                g.points.append(search.check(g.cluster, rate))
        g.points.sort(key=lambda p: p.rate)


def plot_attainment(report: PlanReport, path: str) -> None:
    """Share of requests within both SLOs against the offered rate, one line per shape: SVG
    written here (no dependency), PNG or PDF with matplotlib."""
    slo = report.slo
    title = (f"SLO attainment: p{slo.percentile:g} TTFT <= {slo.ttft_s:g} s, "
             f"TPOT <= {slo.tpot_s * 1e3:g} ms")
    series = [Series(g.cluster.label, [(p.rate, p.share_in_slo) for p in g.points]) for g in report.results]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if Path(path).suffix.lower() == ".svg":
        Path(path).write_text(line_chart_svg(series, title, "request rate (req/s, log scale)",
                                             "share of requests within both SLOs", slo.percentile / 100))
    else:
        _plot_matplotlib(series, title, slo.percentile / 100, path)
    print(f"plot written to {path}")


def _plot_matplotlib(series: list[Series], title: str, target: float, path: str) -> None:
    check_plot_path(path)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for s in series:
        ax.plot([x for x, _ in s.points], [y for _, y in s.points], "-o", ms=3, label=s.label)
    ax.axhline(target, color="grey", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("share of requests within both SLOs")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# ----------------------------------------------------------------------------- DistServe mode

def run_distserve(profile_path: str, model: str | None, tps: list[int] | None, workload: Workload,
                  slo: DistServeSLO, max_rate: float, seed: int) -> list[DistServeConfig]:
    """DistServe's search over (tp_prefill, tp_decode) on one P and one D instance; best first."""
    path = Path(profile_path)
    obj = json.loads(path.read_text())
    if not is_distserve_format(obj):
        raise ValueError(f"--latency-model distserve needs a profile in DistServe's format; "
                         f"{path} is not one")
    if model is None and len(obj) == 1:
        model = next(iter(obj))
    if model is None or model not in obj:
        raise ValueError(f"model {model!r} is not in profile {path}; it has: {', '.join(obj)} "
                         "(choose with --model)")
    available = sorted(int(t) for t in obj[model])
    tps = tps or available
    missing = [t for t in tps if t not in available]
    if missing:
        raise ValueError(f"{model} in {path} has no entry for TP {missing}; it has TP {available}")
    lengths = [(r.input_len, r.output_len) for r in workload.requests]
    configs = []
    for tp_p in tps:
        limit = distserve_max_tokens(path, model, tp_p)
        if limit is None:
            raise ValueError(f"max_num_tokens.csv next to {path} has no row for {model} tp={tp_p} pp=1")
        for tp_d in tps:
            _, c_p = distserve_coeffs(obj, model, tp_p, str(path))
            _, c_d = distserve_coeffs(obj, model, tp_d, str(path))
            configs.append(distserve_goodput(lengths, c_p, c_d, DistServeConfig(tp_p, tp_d), limit, slo,
                                             max_rate, seed))
    configs.sort(key=lambda c: (-c.per_gpu_rate, c.num_gpus))
    return configs


def print_distserve(configs: list[DistServeConfig], model: str, slo: DistServeSLO) -> None:
    print(f"DistServe mode: {model}, SLO p{slo.percentile:g} TTFT < {slo.ttft_ms:g} ms, "
          f"TPOT < {slo.tpot_ms:g} ms; bisection on the per-GPU rate to a width of 0.25")
    print(f"\n  {'tp_prefill':>10}{'tp_decode':>10}{'GPUs':>6}{'per-GPU rate':>14}{'total rate':>12}")
    for c in configs:
        print(f"  {c.tp_prefill:>10}{c.tp_decode:>10}{c.num_gpus:>6}{c.per_gpu_rate:>14.3g}"
              f"{c.per_gpu_rate * c.num_gpus:>12.3g}")
    best = configs[0]
    if best.per_gpu_rate <= 0:
        raise PlanError(f"no (tp_prefill, tp_decode) of {model} meets the SLOs at any per-GPU rate above "
                        "0.25: relax the SLOs or shorten the workload's prompts")
    print(f"\nbest: tp_prefill={best.tp_prefill}, tp_decode={best.tp_decode}, "
          f"{best.per_gpu_rate:.3g} req/s per GPU")


def shapes_for(max_instances: int, only: str | None, configs: str | None) -> list[ClusterSpec]:
    if configs:
        return parse_shapes(configs)
    return cluster_shapes(max_instances, colocated=only != "disaggregated", disaggregated=only != "colocated")


def check_profiles(profile: Profile, pd_profile: Profile | None) -> None:
    if pd_profile is not None and pd_profile.model != profile.model:
        raise ValueError(f"--pd-profile is of {pd_profile.model!r} but --profile of {profile.model!r}: "
                         "both must profile the same model")

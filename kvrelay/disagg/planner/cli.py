"""`kvrelay profile` and `kvrelay plan`: argument parsing; the work is in the planner modules."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvrelay.entrypoints.engine_args import EngineArgs, add_engine_args

# The synthetic workload `kvrelay plan` simulates without --trace (its length defaults are the
# --input-len and --output-len flags'): how many requests, and the rate they arrive at.
SYNTHETIC_REQUESTS = 200
SYNTHETIC_RATE = 1.0  # req/s


def add_parser(sub: Any) -> None:
    _add_profile_parser(sub)
    _add_plan_parser(sub)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


# ----------------------------------------------------------------------------- profile

def _add_profile_parser(sub: Any) -> None:
    p = sub.add_parser("profile", help="measure this instance's latency model into a JSON profile")
    p.add_argument("-o", "--output", default="profile.json", help="where to write the profile")
    p.add_argument("--quick", action="store_true", help="a tiny grid (seconds; for tests and a first look)")
    p.add_argument("--prefill-tokens", type=_ints, default=None, help="batch token counts, e.g. 16,256,2048")
    p.add_argument("--prefill-seqs", type=_ints, default=None, help="sequences a prefill batch is split over")
    p.add_argument("--prefix-tokens", type=_ints, default=None, help="cached prefix lengths, e.g. 0,512")
    p.add_argument("--decode-batch", type=_ints, default=None, help="decode batch sizes, e.g. 1,8,32")
    p.add_argument("--decode-context", type=_ints, default=None, help="context per sequence, e.g. 64,1024")
    p.add_argument("--transfer-tokens", type=_ints, default=None, help="KV transfer sizes in tokens")
    p.add_argument("--backends", default=None,
                   help="transfer backends to time (default: tcp, and nixl if importable)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per case (the best is kept)")
    p.add_argument("--max-seconds", type=float, default=600.0,
                   help="stop sampling after this long (default 600)")
    p.add_argument("--request-overhead-ms", type=float, default=0.0,
                   help="fixed per-request cost outside engine steps (HTTP, tokenizing) to record")
    p.add_argument("--pd-hop-ms", type=float, default=0.0,
                   help="the proxy's extra hop between P and D to record")
    p.add_argument("--step-overhead-ms", type=float, default=0.0,
                   help="cost a served step adds beyond the engine's (server loop, streaming) to record")
    p.add_argument("--co-run", choices=("auto", "on", "off"), default="auto",
                   help="also measure how much slower steps get while a neighbour instance computes on "
                        "the other cores, as kvrelay up's P and D do (auto: when the machine has the "
                        "cores for two instances of --threads)")
    p.add_argument("--no-progress", action="store_true")
    add_engine_args(p, "profile", title="engine (as the instance will run)")
    p.set_defaults(func=cmd_profile)


def profile_grid(args: argparse.Namespace) -> Any:
    from dataclasses import replace

    from kvrelay.disagg.planner.profiler import QUICK_GRID, ProfileGrid
    grid = QUICK_GRID if args.quick else ProfileGrid()
    overrides = {name: getattr(args, name) for name in ("prefill_tokens", "prefill_seqs", "prefix_tokens",
                                                         "decode_batch", "decode_context", "transfer_tokens",
                                                         "reps") if getattr(args, name) is not None}
    return replace(grid, **overrides)


def cmd_profile(args: argparse.Namespace) -> int:
    from kvrelay.disagg.planner.profiler import available_cpus, run_profile

    if args.max_seconds <= 0:
        raise ValueError(f"--max-seconds must be > 0, got {args.max_seconds}")
    grid = profile_grid(args)
    backends = [b.strip() for b in args.backends.split(",")] if args.backends else None
    for b in backends or []:
        if b not in ("tcp", "nixl"):
            raise ValueError(f"unknown transfer backend {b!r}: use tcp and/or nixl")
    engine_args = EngineArgs.from_cli_args(args)
    config = engine_args.create_engine_config()
    engine_args.set_torch_threads()
    import torch

    from kvrelay.engine.llm_engine import LLMEngine
    engine = LLMEngine(config)
    threads = args.threads or torch.get_num_threads()
    # NOTE: "auto" measures a neighbour on the other cores, as `kvrelay up` runs instances on the CPU.
    co_run = args.co_run == "on" or (args.co_run == "auto" and config.model.device == "cpu"
                                     and 2 * threads <= available_cpus())
    profile = run_profile(engine, grid, args.max_seconds, args.threads, backends, not args.no_progress,
                          co_run=co_run)
    profile.overhead_ms = {"request": args.request_overhead_ms, "pd_hop": args.pd_hop_ms,
                           "step": args.step_overhead_ms}
    profile.save(args.output)
    print(f"profile of {profile.model} ({profile.threads} thread(s)) written to {args.output}: "
          f"{len(profile.samples['prefill'])} prefill, {len(profile.samples['decode'])} decode, "
          f"{len(profile.samples['transfer'])} transfer samples; {profile.num_blocks} KV blocks")
    return 0


# ----------------------------------------------------------------------------- plan

def _add_plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="simulate colocated and xPyD clusters: goodput and the P:D split")
    p.add_argument("--profile", required=True, help="a kvrelay profile, or DistServe's profile JSON")
    p.add_argument("--pd-profile", default=None,
                   help="profile for the P and D instances (default: --profile)")
    p.add_argument("--model", default=None, help="the model inside a DistServe profile")
    p.add_argument("--tp", type=int, default=1, help="DistServe profile: tensor parallel size of an instance")
    w = p.add_argument_group("workload")
    w.add_argument("--trace", default=None,
                   help="Mooncake JSONL trace (default: a synthetic workload: Poisson arrivals at --rate, "
                        "lengths from --input-len and --output-len, no shared prefixes)")
    w.add_argument("--num-requests", type=int, default=None,
                   help=f"first N requests of the trace (synthetic: N requests, default "
                        f"{SYNTHETIC_REQUESTS})")
    w.add_argument("--arrivals", choices=("scaled", "poisson"), default=None,
                   help="re-rating: scale the trace's timestamps (default for a trace) or fresh Poisson gaps "
                        "(default for a synthetic workload)")
    w.add_argument("--input-len", default="512",
                   help="synthetic prompt lengths: N, A-B or exp:MEAN (default %(default)s)")
    w.add_argument("--output-len", default="128",
                   help="synthetic output lengths: N, A-B or exp:MEAN (default %(default)s)")
    w.add_argument("--rate", type=float, default=None,
                   help="target rate (req/s) for 'instances needed' (default: the trace's own rate; a "
                        f"synthetic workload's is {SYNTHETIC_RATE:g} req/s, its arrivals drawn at that rate)")
    s = p.add_argument_group("SLOs and search")
    s.add_argument("--ttft-slo", type=float, default=2.0, help="seconds (default 2)")
    s.add_argument("--tpot-slo", type=float, default=0.1, help="seconds (default 0.1)")
    s.add_argument("--percentile", type=float, default=90.0)
    s.add_argument("--max-instances", type=int, default=4)
    s.add_argument("--only", choices=("colocated", "disaggregated"), default=None)
    s.add_argument("--configs", default=None, help="explicit shapes, e.g. 1,2,1P1D,2P1D")
    s.add_argument("--needed-only", action="store_true",
                   help="skip the goodput search: only the smallest shapes meeting the SLOs at --rate")
    s.add_argument("--tolerance", type=float, default=0.05, help="relative width where bisection stops")
    s.add_argument("--max-rate", type=float, default=None, help="highest rate searched (distserve: per GPU)")
    s.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("model of the engine")
    m.add_argument("--latency-model", choices=("kvrelay", "distserve"), default="kvrelay",
                   help="distserve: DistServe's own simulator and search (needs DistServe's profile)")
    m.add_argument("--distserve-tp", type=_ints, default=None, help="TP sizes searched in distserve mode")
    m.add_argument("--no-prefix-cache", action="store_true", help="ignore the trace's shared prefixes")
    m.add_argument("--max-num-batched-tokens", type=int, default=None)
    m.add_argument("--max-num-seqs", type=int, default=None)
    m.add_argument("--backend", default=None,
                   help="transfer backend in the profile (default: nixl, else tcp)")
    m.add_argument("--link-bandwidth", type=float, default=None,
                   help="P->D link GB/s (overrides the profile)")
    m.add_argument("--link-scope", default="per-prefill", help="per-prefill (default), per-pair or shared")
    m.add_argument("--shared-host", action="store_true",
                   help="every instance of a shape runs on one machine, as kvrelay up runs them: a step "
                        "slows by the profile's co_run_slowdown while another instance computes")
    o = p.add_argument_group("output")
    o.add_argument("--plot", default=None,
                   help="write the attainment-vs-rate plot here: FILE.svg (no dependency), "
                        "or .png/.pdf (needs matplotlib)")
    o.add_argument("--json-out", default=None)
    p.set_defaults(func=cmd_plan)


def load_workload(args: argparse.Namespace) -> Any:
    from kvrelay.disagg.planner.workload import load_mooncake_trace, synthetic_workload
    if args.trace:
        workload = load_mooncake_trace(args.trace).head(args.num_requests)
        if args.no_prefix_cache:
            workload = workload.without_prefixes()
        return workload
    return synthetic_workload(args.num_requests or SYNTHETIC_REQUESTS, args.rate or SYNTHETIC_RATE,
                              args.input_len, args.output_len, args.seed)


def target_rate(args: argparse.Namespace, workload: Any) -> tuple[float, str]:
    """The rate 'instances needed' is answered at, and where it came from (the report says)."""
    if args.rate is not None:
        return args.rate, "--rate"
    if args.trace:
        return workload.rate, (f"the trace's own rate: {len(workload.requests)} requests over "
                               f"{workload.duration_s:.0f} s; --rate sets another")
    return SYNTHETIC_RATE, (f"the synthetic workload's default rate, {SYNTHETIC_RATE:g} req/s; "
                            "--rate sets another")


def cmd_plan(args: argparse.Namespace) -> int:
    workload = load_workload(args)
    if args.plot and args.latency_model == "distserve":
        raise ValueError("--plot draws kvrelay's simulator's attainment; DistServe mode has no plot")
    if args.latency_model == "distserve":
        return _plan_distserve(args, workload)
    from kvrelay.disagg.planner.plan import (
        check_plot_path,
        check_profiles,
        fill_curves,
        plot_attainment,
        print_report,
        run_plan,
        shapes_for,
    )
    from kvrelay.disagg.planner.plan import write_json as write_plan_json
    from kvrelay.disagg.planner.profile import load_profile
    from kvrelay.disagg.planner.search import GoodputSearch, SearchOptions
    from kvrelay.disagg.planner.sim import SLO, SimOptions

    engine_args = {"model": args.model, "tp": args.tp}
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    profile = load_profile(args.profile, **engine_args)  # type: ignore[arg-type]
    pd_profile = load_profile(args.pd_profile, **engine_args) if args.pd_profile else None  # type: ignore[arg-type]
    check_profiles(profile, pd_profile)
    if args.plot:
        check_plot_path(args.plot)
        if args.needed_only:
            raise ValueError("--plot needs the goodput search: drop --needed-only")
    if args.shared_host and not any(p.co_run_slowdown for p in (profile, pd_profile) if p is not None):
        print("plan: note: the profile has no co_run_slowdown, so --shared-host changes nothing; "
              "measure it with `kvrelay profile --co-run on`", file=sys.stderr)
    slo = SLO(args.ttft_slo, args.tpot_slo, args.percentile)
    sim = SimOptions(prefix_cache=not args.no_prefix_cache,
                     max_num_batched_tokens=args.max_num_batched_tokens,
                     max_num_seqs=args.max_num_seqs, backend=args.backend,
                     link_bandwidth_gbs=args.link_bandwidth, link_scope=args.link_scope,
                     shared_host=args.shared_host)
    arrivals = args.arrivals or ("scaled" if args.trace else "poisson")
    search = GoodputSearch(profile, workload, slo, sim,
                           SearchOptions(arrivals=arrivals, seed=args.seed, tolerance=args.tolerance,
                                         max_rate=args.max_rate or 1000.0), pd_profile)
    shapes = shapes_for(args.max_instances, args.only, args.configs)
    rate, rate_source = target_rate(args, workload)
    report = run_plan(search, shapes, rate, needed_only=args.needed_only, rate_source=rate_source)
    print_report(report, f"plan: {profile.model} ({profile.source}), workload {workload.name}: "
                         f"{len(workload.requests)} requests, "
                         f"prefix reuse {'off' if args.no_prefix_cache else 'on'}")
    if args.plot:
        fill_curves(search, report)  # before the JSON, so it holds every plotted point
    if args.json_out:
        write_plan_json(report, args.json_out)
    if args.plot:
        plot_attainment(report, args.plot)
    return 0


def _plan_distserve(args: argparse.Namespace, workload: Any) -> int:
    from kvrelay.disagg.planner.distserve import DistServeSLO
    from kvrelay.disagg.planner.plan import print_distserve, run_distserve

    slo = DistServeSLO(args.ttft_slo * 1e3, args.tpot_slo * 1e3, args.percentile)
    configs = run_distserve(args.profile, args.model, list(args.distserve_tp or []) or None, workload, slo,
                            args.max_rate or 10.0, args.seed)
    print_distserve(configs, args.model or "the profile's model", slo)
    return 0


if __name__ == "__main__":  # pragma: no cover
    from kvrelay.entrypoints.cli import main
    sys.exit(main(["plan", *sys.argv[1:]]))

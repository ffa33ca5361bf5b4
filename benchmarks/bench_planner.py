"""Planner against measurement: predict bench_serving's scenarios, then measure them, in one run.

    # the same scenarios as `make bench-serving` (one instance vs kvrelay up 1P1D, same threads)
    .venv/bin/python benchmarks/bench_planner.py --rates 0.25,0.5,1 --num-requests 8 --max-tokens 24 \
        --long-words 150,300 --json-out benchmarks/results/bench_planner.json

Steps:
1. `kvrelay profile` of the default model twice, in child processes: with half the threads (what
   each of kvrelay up's P and D gets; this one also measures how much slower a step gets while
   a neighbour instance computes on the other cores, `--co-run`) and with all of them (the
   single instance). The P/D prediction runs both instances on one shared host, as kvrelay up
   does.
2. bench_serving's workload (same seed, prompts, gaps, output length) turned into planner
   requests: each prompt tokenized as the server does (chat template), arrivals at gap / rate.
3. Calibration: a few requests sent one at a time to each target before the load. The median of
   (measured - predicted TPOT) is what a served step costs beyond an engine step (the server
   loop, streaming); with it included, the median of (measured - predicted TTFT) is the fixed
   per-request cost (HTTP, tokenizing, the proxy's hop). Both go into the prediction; nothing
   from the loaded runs is used.
4. The prediction (the planner's simulator) and the measurement (bench_serving's own load
   generator, `run_rate`) for each rate, and a table: TTFT and TPOT p50/p90 predicted vs
   measured with the error, within 25% or not, and whether P/D beats the single instance (the
   higher share of requests within both SLOs; a tie goes to the lower p90 latencies).
`--predict-only` skips 3 and 4 (no servers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_serving  # noqa: E402

from kvrelay.disagg.planner import corun  # noqa: E402
from kvrelay.disagg.planner.profile import Profile, load_profile  # noqa: E402
from kvrelay.disagg.planner.sim import ClusterSpec, SimOptions, SimResult, percentile, simulate  # noqa: E402
from kvrelay.disagg.planner.workload import RequestSpec, Workload  # noqa: E402

TOLERANCE = 0.25
METRICS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")
SINGLE, PD = "single", "P/D"
CALIBRATION_TOKENS = 8  # output tokens of an idle calibration request (7 gaps for its TPOT)
PROFILE_GRID = ("--prefill-tokens", "16,64,128,256,512,1024", "--prefill-seqs", "1,2",
                "--prefix-tokens", "0,256", "--decode-batch", "1,2,4,8", "--decode-context", "64,256,512",
                "--transfer-tokens", "64,256,1024", "--reps", "2")


@dataclass
class Latencies:
    ttft_s: list[float]
    tpot_s: list[float]
    share_in_slo: float = 0.0

    def summary(self) -> dict[str, float]:
        return {"ttft_p50": percentile(self.ttft_s, 50), "ttft_p90": percentile(self.ttft_s, 90),
                "tpot_p50": percentile(self.tpot_s, 50), "tpot_p90": percentile(self.tpot_s, 90)}


@dataclass
class Scenario:
    rate: float
    predicted: dict[str, Latencies] = field(default_factory=dict)
    measured: dict[str, Latencies] = field(default_factory=dict)


# ----------------------------------------------------------------------------- profiles


def profile(threads: int, args: argparse.Namespace, out: Path) -> Profile:
    cmd = [sys.executable, "-m", "kvrelay.entrypoints.cli", "profile", *([args.model] if args.model else []),
           "--threads", str(threads), "--kv-cache-memory", args.kv_cache_memory, "-o", str(out),
           "--max-seconds", str(args.profile_seconds), *PROFILE_GRID]
    print(f"profiling with {threads} thread(s): {' '.join(cmd[2:])}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run(cmd, check=True, env=env)
    return load_profile(out)


# ----------------------------------------------------------------------------- workload


def planner_workload(wl: bench_serving.Workload, rate: float, run: int, model: str | None,
                     block_size: int = 16) -> Workload:
    """bench_serving's requests as the planner sees them: token counts and arrival times."""
    tokenizer = _tokenizer(model)
    requests, now = [], 0.0
    for prompt, gap in zip(wl.prompts, wl.gaps, strict=True):
        now += gap / rate
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"[run {run}] {prompt}"}])
        token_ids = tokenizer.encode(text)
        requests.append(RequestSpec(now, len(token_ids), wl.max_tokens, block_ids(token_ids, block_size)))
    return Workload(tuple(requests), name=f"bench_serving@{rate:g}", hash_block_tokens=block_size)


def block_ids(token_ids: list[int], block_size: int) -> tuple[int, ...]:
    """An id per full block of the prompt that stands for every token up to it (a chained hash,
    as the engine's prefix cache keys blocks), so the simulator finds the prompts' shared
    prefix (the chat template's system prompt) in its prefix cache as the server does."""
    ids, parent = [], 0
    for end in range(block_size, len(token_ids) + 1, block_size):
        parent = hash((parent, tuple(token_ids[end - block_size:end])))
        ids.append(parent)
    return tuple(ids)


_TOKENIZERS: dict[str | None, Any] = {}


def _tokenizer(model: str | None) -> Any:
    if model not in _TOKENIZERS:
        from kvrelay.model.loader import load_model
        _TOKENIZERS[model] = load_model(model).tokenizer
    return _TOKENIZERS[model]


def latencies(result: SimResult) -> Latencies:
    return Latencies(list(result.ttft_s), list(result.tpot_s))


CLUSTERS = {SINGLE: ClusterSpec(num_colocated=1), PD: ClusterSpec(num_prefill=1, num_decode=1)}


# kvrelay up runs P and D on this one machine: each slows while the other computes
# (the profile's co_run_slowdown; docs/planning.md)
SHARED_HOST = SimOptions(shared_host=True)


def predict(profiles: dict[str, Profile], wl: Workload) -> dict[str, Latencies]:
    return {k: latencies(simulate(CLUSTERS[k], profiles[k], wl, SHARED_HOST)) for k in (SINGLE, PD)}


def with_overhead(p: Profile, calibrated: dict[str, float]) -> Profile:
    """The profile with a target's calibrated constants: overhead_ms request and step, and the
    step_time_scale."""
    overheads = {k: v for k, v in calibrated.items() if k in ("request", "step")}
    return replace(p, overhead_ms={**p.overhead_ms, **overheads},
                   step_time_scale=calibrated.get("scale", p.step_time_scale))


# ----------------------------------------------------------------------------- measurement


Calibration = list[tuple[RequestSpec, float, float]]  # (idle request, measured TTFT s, TPOT s)


def measure_target(url: str, label: str, args: argparse.Namespace,
                   wl: bench_serving.Workload) -> tuple[Calibration, dict[float, Latencies]]:
    """Idle calibration requests, then every rate: the calibration samples and the latencies."""
    model = args.model_name or bench_serving.served_model(url)
    by_length = sorted(wl.prompts, key=len)
    for prompt in (by_length[-1], by_length[0]):  # lazy initialisation off the clock, as bench_serving
        asyncio.run(bench_serving.run_rate(url, model, bench_serving.Workload((prompt,), (0.0,), 4), 1.0,
                                           "chat", args.request_timeout, tag="warmup"))
    samples = calibrate(url, model, args, by_length)
    measured = {}
    for run, rate in enumerate(args.rates):
        results, duration = asyncio.run(bench_serving.run_rate(url, model, wl, rate, "chat",
                                                               args.request_timeout, tag=f"run {run}"))
        ok = [r for r in results if r.ok and r.ttft is not None]
        measured[rate] = Latencies([r.ttft or 0.0 for r in ok], [r.tpot or 0.0 for r in ok],
                                   share_in_slo(results, args))
        print(f"  [{label}] rate {rate:g}: {len(ok)}/{len(results)} ok in {duration:.1f} s", flush=True)
    return samples, measured


def calibrate(url: str, model: str, args: argparse.Namespace, prompts: list[str]) -> Calibration:
    """Idle requests one at a time, before the load, the shortest and the longest prompts in
    turn (so TTFT spreads over prefill lengths): what each took, for `overheads_from`."""
    samples = []
    ends = [p for pair in zip(prompts, reversed(prompts), strict=True) for p in pair]
    for i in range(args.calibration_requests):
        one = bench_serving.Workload((ends[i % len(ends)],), (0.0,), CALIBRATION_TOKENS)
        results, _ = asyncio.run(bench_serving.run_rate(url, model, one, 1.0, "chat", args.request_timeout,
                                                        tag=f"calibrate {i}"))
        if results[0].ok and results[0].ttft is not None and results[0].tpot is not None:
            spec = replace(planner_workload(one, 1.0, 0, args.model).requests[0], arrival_s=0.0)
            samples.append((spec, results[0].ttft, results[0].tpot))
    return samples


MIN_SCALE_SPREAD_MS = 50.0  # predicted TTFT spread of the idle requests needed to fit a scale


def overheads_from(samples: Calibration, prof: Profile, cluster: ClusterSpec,
                   scaled: bool = False) -> dict[str, float]:
    """The target's constants from idle requests (one at a time, before the load), for this step
    model: with `scaled`, "scale" is the slope of measured TTFT against the TTFT the profile
    predicts (short and long prompts: how fast this target computes compared to the profile,
    e.g. 2 on a CPU that others share), when the predictions spread enough to fit a slope;
    then "step", the median excess of measured TPOT over the scaled prediction (what a served
    step adds: the server loop, streaming); then "request", the median excess of TTFT over the
    prediction with both (HTTP, tokenizing, the proxy's hop)."""
    if not samples:
        return {"request": 0.0, "step": 0.0, "scale": 1.0}

    def predicted(p: Profile, spec: RequestSpec) -> tuple[float, float]:
        result = simulate(cluster, p, Workload((spec,)))
        return result.ttft_s[0], result.tpot_s[0]

    scale = 1.0
    if scaled:
        pred = [predicted(prof, spec)[0] for spec, _, _ in samples]
        if (max(pred) - min(pred)) * 1e3 >= MIN_SCALE_SPREAD_MS:
            scale = min(10.0, max(0.5, _slope(pred, [ttft for _, ttft, _ in samples])))
    prof = replace(prof, step_time_scale=scale)
    step_ms = max(0.0, statistics.median((tpot - predicted(prof, spec)[1]) * 1e3
                                         for spec, _, tpot in samples))
    with_step = replace(prof, overhead_ms={**prof.overhead_ms, "step": step_ms})
    request_ms = max(0.0, statistics.median((ttft - predicted(with_step, spec)[0]) * 1e3
                                            for spec, ttft, _ in samples))
    return {"request": request_ms, "step": step_ms, "scale": scale}


def _slope(x: list[float], y: list[float]) -> float:
    """Least-squares slope of y against x."""
    mx, my = statistics.fmean(x), statistics.fmean(y)
    return sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / sum((a - mx) ** 2 for a in x)


def share_in_slo(results: list[Any], args: argparse.Namespace) -> float:
    good = sum(1 for r in results if r.ok and r.ttft is not None and r.ttft <= args.ttft_slo
               and (r.tpot is None or r.tpot <= args.tpot_slo))
    return good / len(results)


def sim_share(lat: Latencies, args: argparse.Namespace) -> float:
    good = sum(1 for a, b in zip(lat.ttft_s, lat.tpot_s, strict=True)
               if a <= args.ttft_slo and b <= args.tpot_slo)
    return good / len(lat.ttft_s)


def measure(args: argparse.Namespace,
            wl: bench_serving.Workload) -> tuple[dict[str, Calibration], dict[str, dict[float, Latencies]]]:
    """kvrelay up (1P1D) first, then one serve with all the threads, as bench_serving --compare."""
    from kvrelay.disagg.launcher import ClusterSpec as UpSpec
    from kvrelay.disagg.launcher import LocalCluster, single_instance

    serve_args = ("--kv-cache-memory", args.kv_cache_memory)
    spec = UpSpec(model=args.model, port=0, threads_per_instance=max(1, args.threads // 2),
                  serve_args=serve_args, startup_timeout=600)
    print(f"starting kvrelay up (1P1D, {spec.threads} thread(s) each) ...", flush=True)
    with LocalCluster(spec) as cluster:
        pd = measure_target(cluster.url, PD, args, wl)
    print(f"starting one kvrelay serve ({args.threads} thread(s)) ...", flush=True)
    with single_instance(args.model, args.threads, serve_args) as single:
        one = measure_target(single.url, SINGLE, args, wl)
    return {PD: pd[0], SINGLE: one[0]}, {PD: pd[1], SINGLE: one[1]}


# ----------------------------------------------------------------------------- report


def pd_better(lat: dict[str, Latencies], args: argparse.Namespace, measured: bool) -> bool:
    share = {k: (v.share_in_slo if measured else sim_share(v, args)) for k, v in lat.items()}
    if share[PD] != share[SINGLE]:
        return share[PD] > share[SINGLE]
    score = {k: v.summary()["ttft_p90"] / args.ttft_slo + v.summary()["tpot_p90"] / args.tpot_slo
             for k, v in lat.items()}
    return score[PD] < score[SINGLE]


def print_table(scenarios: list[Scenario], args: argparse.Namespace, verbose: bool = True) -> dict[str, Any]:
    """Per rate and target, predicted against measured; `verbose=False` prints the totals only."""
    rows, verdicts = [], []
    say = print if verbose else (lambda *_: None)
    for sc in scenarios:
        say(f"\nrate {sc.rate:g} req/s")
        say(f"  {'':10}{'metric':10}{'predicted':>11}{'measured':>10}{'error':>8}  within 25%")
        for target in (SINGLE, PD):
            pred = sc.predicted[target].summary()
            meas = sc.measured[target].summary() if sc.measured else None
            for m in METRICS:
                err = (pred[m] - meas[m]) / meas[m] if meas and meas[m] else float("nan")
                ok = abs(err) <= TOLERANCE if meas else None
                rows.append({"rate": sc.rate, "target": target, "metric": m, "predicted_ms": pred[m] * 1e3,
                             "measured_ms": meas[m] * 1e3 if meas else None, "error": err, "within": ok})
                shown = f"{meas[m] * 1e3:>10.0f}{err:>+8.0%}  {'yes' if ok else 'NO'}" if meas else ""
                say(f"  {target:10}{m:10}{pred[m] * 1e3:>11.0f}{shown}")
        predicted = pd_better(sc.predicted, args, measured=False)
        line = f"  is P/D better here? predicted {'yes' if predicted else 'no'}"
        verdict: dict[str, Any] = {"rate": sc.rate, "predicted_pd_better": predicted}
        if sc.measured:
            actual = pd_better(sc.measured, args, measured=True)
            verdict.update(measured_pd_better=actual, right=predicted == actual)
            line += f", measured {'yes' if actual else 'no'}: {'right' if predicted == actual else 'WRONG'}"
        verdicts.append(verdict)
        say(line)
    measured_rows = [r for r in rows if r["within"] is not None]
    if measured_rows:
        n_ok = sum(1 for r in measured_rows if r["within"])
        n_right = sum(1 for v in verdicts if v.get("right"))
        lead = "\n" if verbose else "  "
        print(f"{lead}within 25%: {n_ok}/{len(measured_rows)} predictions; P/D-or-not right at "
              f"{n_right}/{len(verdicts)} rates")
    return {"rows": rows, "verdicts": verdicts}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model for the instances (default: serve's)")
    p.add_argument("--model-name", default=None)
    p.add_argument("--rates", default="0.25,0.5,1")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--long-fraction", type=float, default=0.25)
    p.add_argument("--short-words", default="8,32")
    p.add_argument("--long-words", default="150,300")
    p.add_argument("--ttft-slo", type=float, default=1.0)
    p.add_argument("--tpot-slo", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="total threads (default: all cores)")
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--profile-seconds", type=float, default=300.0, help="time limit of each profile run")
    p.add_argument("--profiles", default=None,
                   help="reuse two profiles 'SINGLE.json,PD.json' instead of profiling again")
    p.add_argument("--calibration-requests", type=int, default=4)
    p.add_argument("--fit-scale", action="store_true",
                   help="also fit a step-time scale from the idle requests (off by default: on the quiet "
                        "machine it made the predictions worse, see docs/benchmarks/planner.md)")
    p.add_argument("--predict-only", action="store_true", help="no servers: print the predictions only")
    p.add_argument("--replay", default=None,
                   help="no servers: predict against the measurement in an earlier run's --json-out "
                        "(give that run's profiles with --profiles and its workload options)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",") if r]
    if not args.rates or min(args.rates) <= 0:
        p.error(f"rates must be > 0, got {args.rates}")
    args.short_words = tuple(int(x) for x in args.short_words.split(","))
    args.long_words = tuple(int(x) for x in args.long_words.split(","))
    if args.threads is None:
        from kvrelay.disagg.launcher import available_cores
        args.threads = available_cores()
    return args


def compare(profiles: dict[str, Profile], samples: dict[str, Calibration],
            measured: dict[str, dict[float, Latencies]], wl: bench_serving.Workload, args: argparse.Namespace,
            verbose: bool = True, scaled: bool = False) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    """Calibrate each target's constants against these profiles, predict every rate, print."""
    overheads = {k: overheads_from(samples[k], p, CLUSTERS[k], scaled) for k, p in profiles.items()}
    tuned = {k: with_overhead(p, overheads[k]) for k, p in profiles.items()}
    scenarios = []
    for run, rate in enumerate(args.rates):
        sc = Scenario(rate, predict(tuned, planner_workload(wl, rate, run, args.model)))
        if measured:
            sc.measured = {k: v[rate] for k, v in measured.items()}
        scenarios.append(sc)
    shown = {k: f"{v['request']:.1f} ms per request, {v['step']:.1f} ms per step, "
                f"engine steps x{v['scale']:.2f}" for k, v in overheads.items()}
    print(f"{'' if verbose else '  '}calibrated: single {shown[SINGLE]}; P/D {shown[PD]}")
    return {**print_table(scenarios, args, verbose), "overhead_ms": overheads}, overheads


def print_decode_tables(profiles: dict[str, Profile]) -> None:
    for k, p in profiles.items():
        table = ", ".join(f"{b}: {ms:.1f}" for b, ms in sorted(p.decode_by_batch.items()))
        print(f"profile {k} ({p.threads} thread(s)): decode step by batch size, ms less the context term: "
              f"{table or 'none (linear fit only)'}")
        if p.co_run_slowdown:
            print(f"profile {k}: {corun.describe(p.co_run_slowdown)}")


def measurement_json(samples: dict[str, Calibration],
                     measured: dict[str, dict[float, Latencies]]) -> dict[str, Any]:
    """What was measured, so `--replay` can predict against it again without servers."""
    return {"calibration": {k: [[spec.input_len, spec.output_len, ttft, tpot] for spec, ttft, tpot in v]
                            for k, v in samples.items()},
            "measured": {k: {str(rate): {"ttft_s": lat.ttft_s, "tpot_s": lat.tpot_s,
                                         "share_in_slo": lat.share_in_slo} for rate, lat in v.items()}
                         for k, v in measured.items()}}


def load_measurement(path: str) -> tuple[dict[str, Calibration], dict[str, dict[float, Latencies]]]:
    obj = json.loads(Path(path).read_text())
    if "calibration" not in obj or "measured" not in obj:
        raise SystemExit(f"{path} has no measurement to replay (written by a run with --json-out)")
    samples = {k: [(RequestSpec(0.0, int(i), int(o)), ttft, tpot) for i, o, ttft, tpot in v]
               for k, v in obj["calibration"].items()}
    measured = {k: {float(rate): Latencies(m["ttft_s"], m["tpot_s"], m["share_in_slo"])
                    for rate, m in v.items()} for k, v in obj["measured"].items()}
    return samples, measured


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wl = bench_serving.build_workload(args.num_requests, args.long_fraction, args.short_words,
                                      args.long_words, args.max_tokens, args.seed)
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-planner-") as tmp:
        if args.profiles:
            single_path, pd_path = args.profiles.split(",")
            profiles = {SINGLE: load_profile(single_path), PD: load_profile(pd_path)}
        else:
            profiles = {SINGLE: profile(args.threads, args, Path(tmp) / "single.json"),
                        PD: profile(max(1, args.threads // 2), args, Path(tmp) / "pd.json")}
            if args.json_out:
                for name, prof in (("single", profiles[SINGLE]), ("pd", profiles[PD])):
                    prof.save(Path(args.json_out).with_suffix(f".{name}.profile.json"))
    samples: dict[str, Calibration] = {SINGLE: [], PD: []}
    measured: dict[str, dict[float, Latencies]] = {}
    if args.replay:
        samples, measured = load_measurement(args.replay)
    elif not args.predict_only:
        samples, measured = measure(args, wl)
    print_decode_tables(profiles)
    report, _ = compare(profiles, samples, measured, wl, args, scaled=args.fit_scale)
    if any(p.decode_by_batch for p in profiles.values()):
        linear = {k: replace(p, decode_by_batch={}) for k, p in profiles.items()}
        print("\nthe same profiles and measurements, decode steps from the linear fit instead of the "
              "per-batch table (the model before decode_by_batch):")
        report["linear_decode_fit"], _ = compare(linear, samples, measured, wl, args, verbose=False,
                                                 scaled=args.fit_scale)
    if any(p.co_run_slowdown for p in profiles.values()):
        alone = {k: replace(p, co_run_slowdown={}) for k, p in profiles.items()}
        print("\nthe same, without the co-run slowdown (each instance as if it had the machine to itself):")
        report["no_co_run"], _ = compare(alone, samples, measured, wl, args, verbose=False,
                                         scaled=args.fit_scale)
    other = not args.fit_scale
    print(f"\nthe same, {'with' if other else 'without'} the step-time scale fitted from the idle requests:")
    report["fit_scale" if other else "unscaled"], _ = compare(profiles, samples, measured, wl, args,
                                                              verbose=False, scaled=other)
    if args.json_out:
        out = {"args": {k: v for k, v in vars(args).items()}, **report,
               **measurement_json(samples, measured),
               "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(out, indent=1, default=str))
        print(f"results written to {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

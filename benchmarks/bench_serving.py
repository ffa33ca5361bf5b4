"""Online serving benchmark: open-loop load against an OpenAI-compatible endpoint.

    # one endpoint (a `kvrelay up` proxy, a `kvrelay serve`, or vLLM), two request rates
    .venv/bin/python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --rates 0.5,1

    # P/D (kvrelay up, 1P1D) against one `kvrelay serve` with the same total threads, started
    # and stopped by the benchmark itself, one after the other; a table per rate and a PNG
    .venv/bin/python benchmarks/bench_serving.py --compare --rates 0.25,0.5,1 --num-requests 16 \
        --plot docs/benchmarks/bench_serving.png

Requests arrive as a Poisson process at each rate (exponential gaps, fixed seed), whether or
not earlier ones have finished (open loop). The workload is a fixed-seed mix of long and short
prompts with a fixed number of output tokens (ignore_eos), streamed. Per rate it prints TTFT and
inter-token latency (ITL) p50/p90/p99, throughput (completed req/s and output tok/s) and goodput:
the share of requests that met both SLOs (TTFT <= --ttft-slo, mean time per output token after
the first <= --tpot-slo).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # plotting.py, also when loaded from a file path (tests)

import plotting  # noqa: E402
from hostinfo import cpu_summary  # noqa: E402

from kvrelay.disagg.stream_client import StreamResult, stream_completion  # noqa: E402

WORDS = ("the cache keeps keys and values of every token so later steps read them instead of "
         "computing again while a prefill instance reads the whole prompt and a decode instance "
         "writes one token at a time under a budget of memory bandwidth and time").split()


# ----------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Workload:
    prompts: tuple[str, ...]
    gaps: tuple[float, ...]  # seconds before each request, at rate 1 (scaled by 1/rate)
    max_tokens: int


def build_workload(num_requests: int, long_fraction: float, short_words: tuple[int, int],
                   long_words: tuple[int, int], max_tokens: int, seed: int) -> Workload:
    rng = random.Random(seed)
    num_long = round(num_requests * long_fraction)
    is_long = [True] * num_long + [False] * (num_requests - num_long)
    rng.shuffle(is_long)  # exactly `long_fraction` long prompts, at seeded positions
    prompts = []
    for i in range(num_requests):
        low, high = long_words if is_long[i] else short_words
        words = [rng.choice(WORDS) for _ in range(rng.randint(low, high))]
        prompts.append(f"Request {i}: summarize this text. " + " ".join(words))
    gaps = tuple(0.0 if i == 0 else rng.expovariate(1.0) for i in range(num_requests))
    return Workload(tuple(prompts), gaps, max_tokens)


def request_body(prompt: str, model: str, endpoint: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def run_rate(url: str, model: str, workload: Workload, rate: float, endpoint: str,
                   request_timeout: float, tag: str) -> tuple[list[StreamResult], float]:
    """Send the workload at `rate` req/s (Poisson); the results and the wall time.

    Every prompt starts with `tag`, so one run never hits the prefix cache another run filled.
    """
    route = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    limits = httpx.Limits(max_connections=len(workload.prompts) + 4)
    timeout = httpx.Timeout(request_timeout, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        start = time.perf_counter()
        tasks = []
        for prompt, gap in zip(workload.prompts, workload.gaps, strict=True):
            await asyncio.sleep(gap / rate)
            body = request_body(f"[{tag}] {prompt}", model, endpoint, workload.max_tokens)
            tasks.append(asyncio.create_task(stream_completion(client, url + route, body)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


# ----------------------------------------------------------------------------- statistics


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class RateSummary:
    rate: float
    num_requests: int
    num_ok: int
    duration_s: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    tpot_ms_mean: float
    req_per_s: float
    output_tok_per_s: float
    goodput: float  # share of all requests meeting both SLOs
    errors: list[str]


def summarize(rate: float, results: list[StreamResult], duration: float, ttft_slo: float,
              tpot_slo: float) -> RateSummary:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft * 1e3 for r in ok if r.ttft is not None]
    itls = [gap * 1e3 for r in ok for gap in r.itls]
    tpots = [r.tpot * 1e3 for r in ok if r.tpot is not None]

    def meets_slo(r: StreamResult) -> bool:
        return (r.ttft is not None and r.ttft <= ttft_slo
                and (r.tpot is None or r.tpot <= tpot_slo))

    return RateSummary(
        rate=rate, num_requests=len(results), num_ok=len(ok), duration_s=duration,
        ttft_ms={f"p{q}": percentile(ttfts, q) for q in (50, 90, 99)},
        itl_ms={f"p{q}": percentile(itls, q) for q in (50, 90, 99)},
        tpot_ms_mean=statistics.mean(tpots) if tpots else float("nan"),
        req_per_s=len(ok) / duration, output_tok_per_s=sum(r.output_tokens for r in ok) / duration,
        goodput=sum(map(meets_slo, ok)) / len(results),
        errors=sorted({r.error or "" for r in results if not r.ok})[:3])


ROWS = (  # (label, RateSummary field, or field.key of a percentile dict)
    ("TTFT p50 (ms)", "ttft_ms.p50"), ("TTFT p90 (ms)", "ttft_ms.p90"), ("TTFT p99 (ms)", "ttft_ms.p99"),
    ("ITL p50 (ms)", "itl_ms.p50"), ("ITL p90 (ms)", "itl_ms.p90"), ("ITL p99 (ms)", "itl_ms.p99"),
    ("TPOT mean (ms)", "tpot_ms_mean"), ("throughput (req/s)", "req_per_s"),
    ("output tok/s", "output_tok_per_s"), ("goodput (share in SLO)", "goodput"),
)

def value(summary: RateSummary, key: str) -> float:
    head, _, tail = key.partition(".")
    field = getattr(summary, head)
    return float(field[tail] if tail else field)


def fmt(x: float, width: int = 11) -> str:
    text = f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"
    return f"{text:>{width}}"


def print_table(label: str, summaries: list[RateSummary]) -> None:
    print(f"\n{label}")
    print(f"  {'rate (req/s)':24}" + "".join(f"{s.rate:>11g}" for s in summaries))
    print(f"  {'completed':24}" + "".join(f"{f'{s.num_ok}/{s.num_requests}':>11}" for s in summaries))
    for name, key in ROWS:
        print(f"  {name:24}" + "".join(fmt(value(s, key)) for s in summaries))
    for s in summaries:
        if s.errors:
            print(f"  errors at rate {s.rate:g}: {s.errors}")


def print_comparison(pd: list[RateSummary], single: list[RateSummary]) -> None:
    print("\nP/D (kvrelay up, 1P1D) vs single instance, same total threads; ratio = P/D / single")
    for a, b in zip(pd, single, strict=True):
        print(f"\n  rate {a.rate:g} req/s   completed P/D {a.num_ok}/{a.num_requests}, "
              f"single {b.num_ok}/{b.num_requests}")
        print(f"  {'':24}{'P/D':>11}{'single':>11}{'ratio':>9}")
        for name, key in ROWS:
            x, y = value(a, key), value(b, key)
            ratio = f"{x / y:>9.2f}" if y else f"{'n/a':>9}"
            print(f"  {name:24}{fmt(x)}{fmt(y)}{ratio}")


# ----------------------------------------------------------------------------- targets


def served_model(url: str) -> str:
    response = httpx.get(url + "/v1/models", timeout=30, trust_env=False)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def bench_url(url: str, args: argparse.Namespace, workload: Workload, label: str) -> list[RateSummary]:
    url = url.rstrip("/")
    model = args.model_name or served_model(url)
    # Lazy initialisation off the clock: one long and one short prompt, one after the other.
    by_length = sorted(workload.prompts, key=len)
    for prompt in (by_length[-1], by_length[0]):
        asyncio.run(run_rate(url, model, Workload((prompt,), (0.0,), 4), 1.0, args.endpoint,
                             args.request_timeout, tag="warmup"))
    summaries = []
    for run, rate in enumerate(args.rates):
        results, duration = asyncio.run(run_rate(url, model, workload, rate, args.endpoint,
                                                 args.request_timeout, tag=f"run {run}"))
        summaries.append(summarize(rate, results, duration, args.ttft_slo, args.tpot_slo))
        print(f"  [{label}] rate {rate:g}: {summaries[-1].num_ok}/{len(results)} ok in {duration:.1f} s",
              flush=True)
    return summaries


def bench_compare(args: argparse.Namespace,
                  workload: Workload) -> tuple[list[RateSummary], list[RateSummary]]:
    """kvrelay up (1P1D) first, then one serve with all the threads; never both at once."""
    from kvrelay.disagg.launcher import ClusterSpec, LocalCluster, available_cores, single_instance

    total = args.threads or available_cores()
    serve_args = ("--kv-cache-memory", args.kv_cache_memory)
    spec = ClusterSpec(model=args.model, port=0, threads_per_instance=max(1, total // 2),
                       serve_args=serve_args, startup_timeout=600)
    print(f"starting kvrelay up (1P1D, {spec.threads} thread(s) each) ...", flush=True)
    with LocalCluster(spec) as cluster:
        pd = bench_url(cluster.url, args, workload, "P/D")
    print(f"starting one kvrelay serve ({total} thread(s)) ...", flush=True)
    with single_instance(args.model, total, serve_args) as single:
        alone = bench_url(single.url, args, workload, "single")
    return pd, alone


# ----------------------------------------------------------------------------- output


def plot(series: dict[str, list[RateSummary]], path: Path) -> None:
    plt = plotting.pyplot(path)
    if plt is None:
        return

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "itl_ms", "inter-token latency")):
        for (label, summaries), color in zip(series.items(), ("tab:blue", "tab:orange"), strict=False):
            rates = [s.rate for s in summaries]
            for q, style in (("p50", "-o"), ("p90", "--s"), ("p99", ":^")):
                ax.plot(rates, [getattr(s, metric)[q] for s in summaries], style, color=color,
                        label=f"{label} {q}")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    plotting.save(plt, fig, "kvrelay serving latency against request rate", path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="endpoint to load (a proxy, a serve instance, or vLLM)")
    target.add_argument("--compare", action="store_true",
                        help="start kvrelay up (1P1D) and one serve with the same threads; run both")
    p.add_argument("--model", default=None, help="--compare: model path for the instances (default: serve's)")
    p.add_argument("--model-name", default=None, help="model name to send (default: from /v1/models)")
    p.add_argument("--rate", type=float, default=None, help="one request rate (req/s)")
    p.add_argument("--rates", default="0.5,1", help="comma-separated request rates (default 0.5,1)")
    p.add_argument("--num-requests", type=int, default=16, help="requests per rate (default 16)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default 32)")
    p.add_argument("--long-fraction", type=float, default=0.25, help="share of long prompts")
    p.add_argument("--short-words", default="8,32", help="short prompt length range in words")
    p.add_argument("--long-words", default="200,400", help="long prompt length range in words")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--ttft-slo", type=float, default=1.0, help="TTFT SLO in seconds (default 1.0)")
    p.add_argument("--tpot-slo", type=float, default=0.1, help="time-per-output-token SLO in s (default 0.1)")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="--compare: total threads (default: all cores)")
    p.add_argument("--kv-cache-memory", default="256MiB", help="--compare: KV cache per instance")
    p.add_argument("--json-out", default=None, help="write the summaries as JSON here")
    p.add_argument("--plot", default=None,
                   help="--compare: also write the PNG here (e.g. docs/benchmarks/bench_serving.png)")
    args = p.parse_args(argv)
    args.rates = [args.rate] if args.rate is not None else [float(r) for r in args.rates.split(",") if r]
    if not args.rates or min(args.rates) <= 0:
        p.error(f"rates must be > 0, got {args.rates}")
    if args.num_requests < 1:
        p.error(f"--num-requests must be >= 1, got {args.num_requests}")
    args.short_words = tuple(int(x) for x in args.short_words.split(","))
    args.long_words = tuple(int(x) for x in args.long_words.split(","))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload = build_workload(args.num_requests, args.long_fraction, args.short_words, args.long_words,
                              args.max_tokens, args.seed)
    lengths = sorted(len(p.split()) for p in workload.prompts)
    print(cpu_summary())
    print(f"workload: {args.num_requests} requests per rate, prompts of {lengths} words, "
          f"{args.max_tokens} output tokens each, rates {args.rates}; "
          f"SLOs TTFT <= {args.ttft_slo:g} s, TPOT <= {args.tpot_slo * 1e3:g} ms", flush=True)
    if args.compare:
        pd, single = bench_compare(args, workload)
        print_table("P/D (kvrelay up, 1P1D)", pd)
        print_table("single instance", single)
        print_comparison(pd, single)
        series = {"P/D 1P1D": pd, "single": single}
        stamp = time.strftime("%Y%m%d-%H%M%S")
        plot(series, ROOT / "benchmarks" / "results" / f"bench_serving_{stamp}.png")
        if args.plot:
            plot(series, Path(args.plot))
    else:
        summaries = bench_url(args.url, args, workload, args.url)
        print_table(f"{args.url}", summaries)
        series = {args.url: summaries}
    if args.json_out:
        out = {"args": {k: v for k, v in vars(args).items()},
               "results": {label: [asdict(s) for s in ss] for label, ss in series.items()}}
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(out, indent=2, default=str))
        print(f"results written to {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""KV-aware routing against least-loaded on a Mooncake trace, 2 prefill + 2 decode instances.

    .venv/bin/python benchmarks/bench_routing.py                     # both policies, one run
    .venv/bin/python benchmarks/bench_routing.py --families 12 --rate 0.5 --json out.json
    .venv/bin/python benchmarks/bench_routing.py --engine vllm       # vLLM servers (bench_routing_vllm.py)

The workload comes from a Mooncake trace (../shared/data/mooncake_traces; each request lists
the ids of its 512-token prompt blocks, equal ids being a shared prefix). Whole prefix families
are taken (requests whose first two ids agree, in trace order, the first `--families` families
of at least `--min-members` members, `--per-family` members each), so the sample keeps the
trace's reuse. Each id becomes `--tokens-per-id` fixed pseudo-random tokens (32: the trace
scaled down 16x), the prompt is the request's ids' tokens cut to its scaled input length, and
sent as token ids, so two prompts share exactly the blocks their ids share. Arrivals keep the
trace's own gaps, compressed to `--rate` requests per second.

Each policy gets a fresh cluster (`kvrelay up`'s LocalCluster: empty caches) and the same
requests, greedy and streamed. Per policy it prints the prompt tokens computed (every
instance's kvrelay_prompt_tokens_computed_total), client-side TTFT p50/p90, the prefix hit on
the chosen prefill instances (predicted by the proxy's KV index, and actual: P's usage), and
checks that both policies gave identical answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_serving import percentile  # noqa: E402
from hostinfo import cpu_summary  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvrelay.disagg.launcher import ClusterSpec, LocalCluster  # noqa: E402
from kvrelay.disagg.planner.workload import MOONCAKE_BLOCK_TOKENS, RequestSpec, load_mooncake_trace  # noqa: E402
from kvrelay.disagg.stream_client import StreamResult, stream_completion  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "mooncake_traces" / "synthetic_trace.jsonl"
TOKEN_RANGE = (1000, 40000)  # ordinary tokens of SmolLM2's vocabulary (no special tokens)


# ----------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class BenchRequest:
    arrival_s: float
    token_ids: tuple[int, ...]


def pick_families(requests: tuple[RequestSpec, ...], families: int, min_members: int,
                  per_family: int) -> list[RequestSpec]:
    """Whole prefix families (same first two block ids), in trace order."""
    members: dict[tuple[int, ...], list[RequestSpec]] = {}
    for request in requests:
        if len(request.hash_ids) >= 2:
            members.setdefault(request.hash_ids[:2], []).append(request)
    chosen = [m[:per_family] for m in members.values() if len(m) >= min_members][:families]
    if len(chosen) < families:
        raise ValueError(f"the trace has only {len(chosen)} families of {min_members}+ members")
    return sorted((r for family in chosen for r in family), key=lambda r: r.arrival_s)


def block_tokens(hash_id: int, tokens_per_id: int) -> list[int]:
    rng = random.Random(hash_id)  # NOTE: seeded by the id: equal ids, equal tokens, every run
    return [rng.randrange(*TOKEN_RANGE) for _ in range(tokens_per_id)]


def build_requests(trace: Path, families: int, min_members: int, per_family: int, tokens_per_id: int,
                   rate: float) -> list[BenchRequest]:
    picked = pick_families(load_mooncake_trace(trace).requests, families, min_members, per_family)
    start, span = picked[0].arrival_s, picked[-1].arrival_s - picked[0].arrival_s
    scale = (len(picked) - 1) / rate / span if span > 0 else 0.0
    out = []
    for request in picked:
        num_tokens = max(1, request.input_len * tokens_per_id // MOONCAKE_BLOCK_TOKENS)
        tokens = [t for h in request.hash_ids for t in block_tokens(h, tokens_per_id)][:num_tokens]
        out.append(BenchRequest((request.arrival_s - start) * scale, tuple(tokens)))
    return out


# ----------------------------------------------------------------------------- one policy


@dataclass
class PolicyResult:
    policy: str
    num_requests: int
    num_ok: int
    prompt_tokens: int
    computed: int  # prompt tokens run through a model, on every instance
    ttft_p50_ms: float
    ttft_p90_ms: float
    predicted_hit: int | None  # prefix tokens the index predicted on the chosen P (kv-aware)
    actual_hit: int  # prefix tokens P's prefix cache served
    exact_predictions: int
    reasons: dict[str, int]  # prefill routing decisions by reason
    computed_by_role: dict[str, int]
    duration_s: float
    texts: list[str]
    errors: list[str]


def scrape(url: str) -> dict[str, float]:
    """Sum of every sample by name and its labels (`name{k=v,...}`), and by name alone."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in family.samples:
            key = s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
            totals[key] = totals.get(key, 0.0) + s.value
            totals[s.name] = totals.get(s.name, 0.0) + s.value
    return totals


def decisions(proxy: dict[str, float], role: str) -> dict[str, int]:
    """The proxy's routing decisions for `role`, by reason."""
    counts: dict[str, int] = {}
    for key, value in proxy.items():
        if key.startswith("kvrelay_proxy_routing_decisions_total{") and f"role={role}" in key:
            labels = dict(item.split("=", 1) for item in key[key.index("{") + 1:-1].split(","))
            counts[labels["reason"]] = counts.get(labels["reason"], 0) + int(value)
    return counts


def instances_total(cluster: LocalCluster, name: str, which: str = "all") -> float:
    children = {"all": cluster.prefill + cluster.decode, "prefill": cluster.prefill}[which]
    return sum(scrape(c.url).get(name, 0.0) for c in children)


async def replay(url: str, requests: list[BenchRequest], max_tokens: int, prompts: list[Any] | None = None,
                 model: str | None = None) -> tuple[list[StreamResult], float]:
    """Send every request at its arrival time (open loop), streamed; the results and the wall time.
    `prompts`: what to send as each request's prompt (default: its token ids)."""
    limits = httpx.Limits(max_connections=len(requests) + 4)
    timeout = httpx.Timeout(900, connect=10)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        start = time.perf_counter()
        tasks = []
        for i, request in enumerate(requests):
            await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
            body = {"prompt": prompts[i] if prompts is not None else list(request.token_ids),
                    "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
            if model is not None:
                body["model"] = model
            tasks.append(asyncio.create_task(stream_completion(client, url + "/v1/completions", body)))
        results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def warm_up(cluster: LocalCluster) -> None:
    """One short request per instance, on tokens no trace prompt has (TOKEN_RANGE excludes them)."""
    for child in cluster.prefill + cluster.decode:
        body = {"prompt": list(range(100, 164)), "max_tokens": 2, "temperature": 0.0}
        httpx.post(child.url + "/v1/completions", json=body, timeout=300).raise_for_status()


def wait_idle(cluster: LocalCluster, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while instances_total(cluster, "kvrelay_kv_blocks_in_use") > 0 and time.monotonic() < deadline:
        time.sleep(0.5)


def run_policy(policy: str, requests: list[BenchRequest], args: argparse.Namespace) -> PolicyResult:
    serve_args = ("--kv-cache-memory", args.kv_cache_memory, "--log-level", "warning")
    spec = ClusterSpec(model=args.model, port=0, num_prefill=2, num_decode=2, serve_args=serve_args,
                       threads_per_instance=args.threads_per_instance, prefill_routing=policy,
                       decode_routing=policy, startup_timeout=600)
    print(f"[{policy}] starting 2 prefill + 2 decode instances ...", file=sys.stderr, flush=True)
    with LocalCluster(spec) as cluster:
        warm_up(cluster)
        before = instances_total(cluster, "kvrelay_prompt_tokens_computed_total")
        before_p = instances_total(cluster, "kvrelay_prompt_tokens_computed_total", "prefill")
        cached_before = instances_total(cluster, "kvrelay_prompt_tokens_cached_total", "prefill")
        print(f"[{policy}] replaying {len(requests)} requests ...", file=sys.stderr, flush=True)
        results, duration = asyncio.run(replay(cluster.url, requests, args.max_tokens))
        wait_idle(cluster)
        computed = instances_total(cluster, "kvrelay_prompt_tokens_computed_total") - before
        computed_p = instances_total(cluster, "kvrelay_prompt_tokens_computed_total", "prefill") - before_p
        actual = instances_total(cluster, "kvrelay_prompt_tokens_cached_total", "prefill") - cached_before
        proxy = scrape(cluster.url)
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft * 1e3 for r in ok if r.ttft is not None]
    predicted = proxy.get("kvrelay_proxy_prefix_hit_tokens_total{kind=predicted}")
    return PolicyResult(
        policy=policy, num_requests=len(results), num_ok=len(ok),
        prompt_tokens=sum(len(r.token_ids) for r in requests), computed=int(computed),
        ttft_p50_ms=percentile(ttfts, 50), ttft_p90_ms=percentile(ttfts, 90),
        predicted_hit=int(predicted) if predicted is not None else None, actual_hit=int(actual),
        exact_predictions=int(proxy.get("kvrelay_proxy_prefix_predictions_total{outcome=exact}", 0)),
        reasons=decisions(proxy, "prefill"),
        computed_by_role={"prefill": int(computed_p), "decode": int(computed - computed_p)},
        duration_s=duration, texts=[r.text for r in results], errors=[r.error for r in results if r.error])


# ----------------------------------------------------------------------------- report


def print_report(results: list[PolicyResult], args: argparse.Namespace) -> bool:
    print(f"\nbench_routing: {results[0].num_requests} requests from {Path(args.trace).name} "
          f"({args.families} prefix families x {args.per_family}, {args.tokens_per_id} tokens per block id, "
          f"{args.rate} req/s), 2P+2D, max_tokens {args.max_tokens}, greedy")
    print(f"{cpu_summary()}\n")
    print("| routing | ok | prompt tokens | computed | TTFT p50 | TTFT p90 | "
          "prefix hit on P: predicted / actual (exact) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        predicted = "-" if r.predicted_hit is None else f"{r.predicted_hit:,}"
        exact = "" if r.predicted_hit is None else f" ({r.exact_predictions}/{r.num_requests} exact)"
        print(f"| {r.policy} | {r.num_ok}/{r.num_requests} | {r.prompt_tokens:,} | {r.computed:,} | "
              f"{r.ttft_p50_ms:,.0f} ms | {r.ttft_p90_ms:,.0f} ms | {predicted} / {r.actual_hit:,}{exact} |")
    print()
    for r in results:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r.reasons.items()))
        print(f"{r.policy}: computed on P {r.computed_by_role['prefill']:,}, on D "
              f"{r.computed_by_role['decode']:,}; prefill decisions: {reasons}; {r.duration_s:.0f} s")
        for error in r.errors[:3]:
            print(f"  error: {error}")
    by_policy = {r.policy: r for r in results}
    base, kv = by_policy.get("least-loaded"), by_policy.get("kv-aware")
    if base is None or kv is None:
        return True
    fewer = 1 - kv.computed / base.computed if base.computed else 0.0
    faster = 1 - kv.ttft_p50_ms / base.ttft_p50_ms if base.ttft_p50_ms else 0.0
    same = sum(a == b for a, b in zip(base.texts, kv.texts, strict=True))
    complete = base.num_ok == kv.num_ok == base.num_requests
    print(f"\nkv-aware vs least-loaded: {fewer:.0%} fewer prompt tokens computed "
          f"({kv.computed:,} vs {base.computed:,}), TTFT p50 {faster:.0%} lower "
          f"({kv.ttft_p50_ms:,.0f} vs {base.ttft_p50_ms:,.0f} ms), identical answers {same}/{len(kv.texts)}")
    passed = fewer >= 0.30 and faster > 0 and same == len(kv.texts) and complete
    print(f"target (>= 30% fewer prompt tokens, lower TTFT p50, identical answers): "
          f"{'met' if passed else 'NOT met'}")
    return passed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="a Mooncake JSONL trace")
    p.add_argument("--families", type=int, default=8)
    p.add_argument("--min-members", type=int, default=4)
    p.add_argument("--per-family", type=int, default=4)
    p.add_argument("--tokens-per-id", type=int, default=32, help="prompt tokens per 512-token block id")
    p.add_argument("--rate", type=float, default=0.3, help="mean arrival rate, requests per second")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--policies", nargs="+", default=["least-loaded", "kv-aware"])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--kv-cache-memory", default="1GiB", help="per instance")
    p.add_argument("--threads-per-instance", type=int, default=None)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--engine", choices=("kvrelay", "vllm"), default="kvrelay",
                   help="the instances: kvrelay serve (2P+2D), or vLLM servers (bench_routing_vllm.py)")
    from bench_routing_vllm import add_args

    add_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    requests = build_requests(Path(args.trace), args.families, args.min_members, args.per_family,
                              args.tokens_per_id, args.rate)
    if args.engine == "vllm":
        from bench_routing_vllm import main as run_vllm

        passed, vllm_results = run_vllm(args, requests)
        rows = [asdict(r) for r in vllm_results]
    else:
        results = [run_policy(policy, requests, args) for policy in args.policies]
        passed = print_report(results, args)
        rows = [asdict(r) for r in results]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

"""TTFT of long prompts through `kvrelay up` (1P1D, NixlConnector) against one `kvrelay serve`.

Both targets get the same total torch threads (P and D half each, the single instance all) and
run one after the other, never at once. Each prompt is a list of token ids whose first token
differs between every request, so no request hits a prefix another one left in the cache (the
prompts of two sizes would otherwise share a prefix too). One request of the smallest size is a
warm-up off the clock (lazy initialisation, P/D's handshake); TTFT is the median over `reps`
sequential requests, measured by the streaming client from sending the request to the first
text chunk.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time

import httpx

from kvrelay.disagg.launcher import ClusterSpec, LocalCluster, available_cores, single_instance
from kvrelay.disagg.stream_client import stream_completion

MAX_TOKENS = 4
TARGET = 1.1  # P/D TTFT <= 1.1 x single instance


def prompt_token_ids(num_tokens: int, first_token: int) -> list[int]:
    # NOTE: ids 100.. avoid SmolLM2's special tokens (0..16); the body is the same for every
    # request, only the first token tells two prompts apart.
    return [first_token] + [100 + (i * 7919) % 40_000 for i in range(num_tokens - 1)]


def measure_ttfts(url: str, sizes: list[int], reps: int,
                  first_tokens: itertools.count[int]) -> dict[int, list[float]]:
    """Seconds to the first token of `reps` sequential requests per prompt size (after a warm-up)."""
    async def one(client: httpx.AsyncClient, num_tokens: int) -> float:
        body = {"model": model, "prompt": prompt_token_ids(num_tokens, next(first_tokens)),
                "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
        result = await stream_completion(client, url + "/v1/completions", body)
        if not result.ok or result.ttft is None:
            raise RuntimeError(f"a {num_tokens}-token request to {url} failed: {result.error or 'no text'}")
        return result.ttft

    async def all_sizes() -> dict[int, list[float]]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), trust_env=False) as client:
            await one(client, min(sizes))  # warm-up: lazy initialisation, P/D's first handshake
            return {num_tokens: [await one(client, num_tokens) for _ in range(reps)] for num_tokens in sizes}

    model = httpx.get(url + "/v1/models", timeout=30, trust_env=False).json()["data"][0]["id"]
    return asyncio.run(all_sizes())


def bench_ttft(sizes: list[int], reps: int, threads: int | None = None) -> dict[str, dict[int, list[float]]]:
    """P/D (kvrelay up, 1P1D) first, then one serve with all the threads."""
    total = threads or available_cores()
    first_tokens = itertools.count(200)
    spec = ClusterSpec(port=0, threads_per_instance=max(1, total // 2))
    print(f"TTFT: starting kvrelay up (1P1D, NixlConnector, {spec.threads} thread(s) each) ...", flush=True)
    started = time.monotonic()
    with LocalCluster(spec) as cluster:
        print(f"  up in {time.monotonic() - started:.0f} s", flush=True)
        pd = measure_ttfts(cluster.url, sizes, reps, first_tokens)
    print(f"TTFT: starting one kvrelay serve ({total} thread(s)) ...", flush=True)
    with single_instance(None, total) as single:
        alone = measure_ttfts(single.url, sizes, reps, first_tokens)
    return {"P/D": pd, "single": alone}


def print_ttft_table(ttfts: dict[str, dict[int, list[float]]]) -> None:
    pd, single = ttfts["P/D"], ttfts["single"]
    reps = len(next(iter(pd.values())))
    print(f"TTFT in ms, median of {reps} (min..max)")
    print(f"{'prompt':>8}  {'P/D':>22}  {'single':>22}  {'P/D/single':>10}  target <= {TARGET}")
    for num_tokens in pd:
        ratio = statistics.median(pd[num_tokens]) / statistics.median(single[num_tokens])
        print(f"{num_tokens:>8}  {_cell(pd[num_tokens]):>22}  {_cell(single[num_tokens]):>22}  "
              f"{ratio:>10.2f}", flush=True)


def _cell(seconds: list[float]) -> str:
    return (f"{statistics.median(seconds) * 1000:.0f} "
            f"({min(seconds) * 1000:.0f}..{max(seconds) * 1000:.0f})")

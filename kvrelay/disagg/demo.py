"""`kvrelay demo`: watch a P/D cluster work.

Sends a few chat requests through the proxy, streams each answer to the terminal with its TTFT
and inter-token latency, then reads the instances' /metrics (found through the proxy's /health)
and shows where the prompt tokens were computed and how many KV bytes moved between them.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
from dataclasses import dataclass
from typing import Any, TextIO

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.disagg.stream_client import StreamResult, stream_completion

DEMO_PROMPTS = (
    "A KV cache stores the attention keys and values of every token a model has already read. "
    "In two sentences, explain why keeping it makes generating the next token cheaper.",
    "Prefill reads the whole prompt at once and is limited by compute; decode produces one token "
    "at a time and is limited by memory bandwidth. Why might a serving system run them on "
    "different machines?",
    "Write a short haiku about a cache that travels from one computer to another over the "
    "network, arriving just in time for the next word.",
    "List three things that can go wrong when one server hands its work to another halfway "
    "through a request, and how a careful system recovers from each.",
)

# (label, metric sample) rows of the P/D table.
METRIC_ROWS = (
    ("prompt tokens computed", "kvrelay_prompt_tokens_computed_total"),
    ("prompt tokens loaded (KV from elsewhere)", "kvrelay_prompt_tokens_external_total"),
    ("prompt tokens from local prefix cache", "kvrelay_prompt_tokens_cached_total"),
    ("tokens generated", "kvrelay_generation_tokens_total"),
    ("KV bytes moved", "kvrelay_kv_transfer_bytes_total"),
)


def scrape(client: httpx.Client, url: str) -> dict[str, float]:
    """An instance's /metrics as {sample name: value summed over label sets}; {} if unreachable.

    Each labelled series is also kept under `name{label=value,...}`.
    """
    try:
        response = client.get(url + "/metrics")
        response.raise_for_status()
    except httpx.HTTPError:
        return {}
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
            if sample.labels:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                totals[f"{sample.name}{{{labels}}}"] = sample.value
    return totals


@dataclass
class Topology:
    prefill: list[str]
    decode: list[str]


def discover(client: httpx.Client, url: str) -> Topology | None:
    """The backends behind a kvrelay proxy (from its /health); None if `url` is not a proxy."""
    try:
        health = client.get(url + "/health").json()
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(health, dict) or "prefill" not in health or "decode" not in health:
        return None
    return Topology([b["url"] for b in health["prefill"]], [b["url"] for b in health["decode"]])


def served_model(client: httpx.Client, url: str) -> str:
    response = client.get(url + "/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def _pool_totals(snapshots: list[dict[str, float]], sample: str) -> float:
    return sum(s.get(sample, 0.0) for s in snapshots)


def _format_amount(sample: str, value: float) -> str:
    if sample.endswith("bytes_total"):
        for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if value >= size:
                return f"{value / size:.2f} {unit}"
        return f"{value:.0f} B"
    return f"{value:.0f}"


def print_request(index: int, total: int, prompt: str, result: StreamResult, out: TextIO) -> None:
    if not result.ok:
        print(f"\n  request failed: {result.error}", file=out)
        return
    itl = (f"ITL mean {statistics.mean(result.itls) * 1e3:.1f} ms, "
           f"max {max(result.itls) * 1e3:.1f} ms" if result.itls else "ITL n/a (one token)")
    ttft = f"{result.ttft * 1e3:.0f} ms" if result.ttft is not None else "n/a"
    rate = result.output_tokens / result.latency if result.latency else 0.0
    print(f"\n  -> TTFT {ttft}, {itl}, {result.output_tokens} tokens in {result.latency:.2f} s "
          f"({rate:.1f} tok/s), prompt {result.prompt_tokens} tokens", file=out)


def print_disaggregation(before: dict[str, list[dict[str, float]]], after: dict[str, list[dict[str, float]]],
                         proxy_before: dict[str, float], proxy_after: dict[str, float], out: TextIO) -> None:
    print("\nWhere the work happened (change in the instances' /metrics during this demo):", file=out)
    print(f"  {'':42} {'prefill (P)':>14} {'decode (D)':>14}", file=out)
    deltas: dict[tuple[str, str], float] = {}
    for label, sample in METRIC_ROWS:
        cells = []
        for pool in ("prefill", "decode"):
            delta = _pool_totals(after[pool], sample) - _pool_totals(before[pool], sample)
            deltas[(pool, sample)] = delta
            cells.append(f"{_format_amount(sample, delta):>14}")
        print(f"  {label:42} {''.join(c + ' ' for c in cells).rstrip()}", file=out)
    prefix = "kvrelay_proxy_fallbacks_total{reason="
    reasons = {key[len(prefix):-1]: proxy_after[key] - proxy_before.get(key, 0.0)
               for key in proxy_after if key.startswith(prefix)}
    reasons = {reason: n for reason, n in reasons.items() if n}
    print(f"  proxy: prefill legs without usable kv_transfer_params: {sum(reasons.values()):.0f}"
          + (f" ({', '.join(f'{r}: {n:.0f}' for r, n in reasons.items())})" if reasons else ""),
          file=out)
    if set(reasons) == {"no_kv_transfer_params"}:
        print("    (expected with ExampleConnector: P leaves the KV in shared storage instead of "
              "sending a handle, and D finds it there)", file=out)
    d_computed = deltas[("decode", "kvrelay_prompt_tokens_computed_total")]
    d_loaded = deltas[("decode", "kvrelay_prompt_tokens_external_total")]
    p_computed = deltas[("prefill", "kvrelay_prompt_tokens_computed_total")]
    if d_loaded > 0:
        print(f"\nP computed {p_computed:.0f} prompt tokens; D loaded the KV of {d_loaded:.0f} of them "
              f"instead of recomputing, and computed only {d_computed:.0f} itself (the tail that does "
              "not fill a whole block, or just the last token).", file=out)
    else:
        print("\nD loaded no KV: every prompt was computed on D (a fallback, or prompts shorter than "
              "one block).", file=out)


async def _run_requests(url: str, model: str, prompts: list[str], max_tokens: int,
                        out: TextIO, headers: dict[str, str]) -> list[StreamResult]:
    results = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0), trust_env=False,
                                 headers=headers) as client:
        for i, prompt in enumerate(prompts):
            print(f"\n[{i + 1}/{len(prompts)}] user: {prompt}\nassistant: ", end="", file=out, flush=True)
            body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                                    "max_tokens": max_tokens, "temperature": 0.0}
            result = await stream_completion(client, url + "/v1/chat/completions", body,
                                             on_text=lambda t: print(t, end="", file=out, flush=True))
            print_request(i, len(prompts), prompt, result, out)
            results.append(result)
    return results


def run_demo(url: str, num_requests: int = 3, max_tokens: int = 48, prompts: list[str] | None = None,
             out: TextIO = sys.stdout, api_key: str | None = None) -> list[StreamResult]:
    url = url.rstrip("/")
    chosen = prompts or [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(num_requests)]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=10.0, trust_env=False, headers=headers) as client:
        model = served_model(client, url)
        topology = discover(client, url)
        print(f"kvrelay demo: {url} (model {model})", file=out)
        if topology is None:
            print("  (not a kvrelay proxy: no prefill/decode split to show)", file=out)
        else:
            print(f"  prefill: {' '.join(topology.prefill)}\n  decode:  {' '.join(topology.decode)}",
                  file=out)

        def snapshot() -> dict[str, list[dict[str, float]]]:
            assert topology is not None
            return {"prefill": [scrape(client, u) for u in topology.prefill],
                    "decode": [scrape(client, u) for u in topology.decode]}

        before = snapshot() if topology else None
        proxy_before = scrape(client, url)
        results = asyncio.run(_run_requests(url, model, chosen, max_tokens, out, headers))
        if topology is not None and before is not None:
            print_disaggregation(before, snapshot(), proxy_before, scrape(client, url), out)
    return results

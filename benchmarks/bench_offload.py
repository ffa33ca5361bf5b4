"""Offload tiers on the default model (SmolLM2-135M, fp32, CPU): what a stored prefix saves.

In one run, with a real redis-server on a free loopback port (from PATH):

  TTFT      a 2048-, a 3280- and a 4096-token prompt: cold (full prefill, the chunks are stored
            in every tier meanwhile) against warm from each tier alone: cpu (same engine, local
            prefix cache reset), disk (a fresh engine on the same directory; the OS page cache is
            warm), redis (a fresh engine), mooncake (a fresh engine on a Mooncake Store: a
            mooncake_master and a client lending it 2GiB, filled by a second cold engine). 3280
            is not a multiple of chunk_tokens: its last 208 tokens are stored as the prompt's tail.
            Each warm run computes one prompt token (the progress lines print how many it did).
            Targets, on every row: speed-up >= 20x cpu, >= 10x disk, >= 5x redis and mooncake.
  store     GB/s of the connector's store path per tier (gather out of the KV cache into
            staging, checksum + header, tier put; measured from copy-out until written) against
            the raw operation on the same bytes: a memcpy, a file write + rename, a Redis SET.
  ITL       decode inter-token latency of one request (all three tiers configured):
            - beside a stream of 512-token prefills (a new one as soon as the last finished), so
              the instance stores 2 chunks per step, as fast as it can compute them; the same
              workload with stores on and with the copy-out switched off, alternated 3 times each.
              Target: stores raise it by <= +10%. Also printed: chunks stored and dropped, and
              how long a chunk waited from copy-out to written (the writer runs on idle CPU time,
              so under this load it falls behind and catches up when the engine idles).
            - stress, no target: alone, against one 256-token chunk stored per decode-only step
              (~40 chunks/s, more than ten times what this instance can compute).

    .venv/bin/python benchmarks/bench_offload.py [--lengths 2048 3280 4096] [--decode-tokens 48]
        [--plot docs/benchmarks/bench_offload.png]

Timings on a shared machine vary with its load: the table prints what this run measured.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import plotting  # benchmarks/plotting.py, beside this script
import torch
from hostinfo import cpu_summary  # benchmarks/hostinfo.py
from mooncake_bench import MooncakeStoreForBench, mooncake_loads  # benchmarks/mooncake_bench.py

from kvrelay import LLM, SamplingParams
from kvrelay.kv_transfer.offload.meta import ChunkSave

CHUNK_TOKENS = 256


def start_redis() -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH: run scripts/install_redis.sh")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def offload_llm(**tiers: Any) -> LLM:
    config = {"kv_connector": "OffloadConnector",
              "kv_connector_extra_config": {"chunk_tokens": CHUNK_TOKENS, "max_pending_stores": 32, **tiers}}
    return LLM(kv_cache_memory="1GiB", kv_transfer_config=config)


def ttft(llm: LLM, prompt: list[int]) -> float:
    """Seconds from add_request to the first output token (stores may still be in flight)."""
    engine = llm.engine
    start = time.perf_counter()
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0.0))
    while True:
        for out in engine.step():
            if out.outputs[0].token_ids:
                elapsed = time.perf_counter() - start
                engine.run_until_idle(timeout_s=600)  # let the stores finish before the next run
                return elapsed


def connector(llm: LLM) -> Any:
    return llm.engine.runner.connector


def close(llm: LLM) -> None:
    connector(llm).shutdown()
    llm.engine.scheduler.connector.shutdown()


def ttft_computing(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """TTFT, and how many prompt tokens the engine computed (the rest it loaded)."""
    before = llm.engine.get_stats()["prompt_tokens_computed"]
    seconds = ttft(llm, prompt)
    return seconds, llm.engine.get_stats()["prompt_tokens_computed"] - before


def measure_ttft(lengths: list[int], disk_dir: str, redis_url: str,
                 mooncake_url: str | None = None) -> dict[tuple[str, int], float]:
    rng = random.Random(0)
    prompts = {n: [rng.randrange(100, 40000) for _ in range(n)] for n in lengths}
    results: dict[tuple[str, int], float] = {}

    def run(tier: str, llm: LLM, n: int) -> None:
        results[(tier, n)], computed = ttft_computing(llm, prompts[n])
        print(f"  {n} tokens: {tier} {results[(tier, n)]:.3f} s, {computed} prompt tokens computed",
              flush=True)
    llm = offload_llm(cpu_bytes="2GiB", disk_dir=disk_dir, remote_url=redis_url)
    for n in prompts:
        run("cold", llm, n)
        llm.engine.scheduler.reset_prefix_cache()
        run("cpu", llm, n)  # the cpu tier is on top: it answers
        llm.engine.scheduler.reset_prefix_cache()
    close(llm)
    for tier, config in (("disk", {"disk_dir": disk_dir}), ("redis", {"remote_url": redis_url})):
        llm = offload_llm(**config)
        for n in prompts:
            run(tier, llm, n)
        close(llm)
    if mooncake_url is not None:  # an engine has one remote tier: a second writer fills Mooncake
        writer = offload_llm(remote_url=mooncake_url)
        for n in prompts:
            ttft(writer, prompts[n])
        close(writer)
        llm = offload_llm(remote_url=mooncake_url)
        for n in prompts:
            run("mooncake", llm, n)
        close(llm)
    return results


def store_throughput(llm: LLM, num_chunks: int) -> float:
    """GB/s of the store path: copy-out in the step, then the writer to the tiers."""
    background = connector(llm).worker.background
    blocks = list(range(CHUNK_TOKENS // llm.engine.config.cache.block_size))
    saves = [ChunkSave("bench", f"{random.getrandbits(160):040x}", blocks) for _ in range(num_chunks)]
    start = time.perf_counter()
    for save in saves:
        background.copy_out([save])
    assert background.wait_idle(600)
    seconds = time.perf_counter() - start
    return num_chunks * connector(llm).worker.store.payload_bytes / seconds / 1e9


def raw_throughput(tier: str, payload: bytes, num_chunks: int, disk_dir: str, redis_url: str) -> float:
    start = time.perf_counter()
    if tier == "cpu":
        src = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        for _ in range(num_chunks):
            torch.empty_like(src).copy_(src)
    elif tier == "disk":
        for i in range(num_chunks):
            tmp, path = os.path.join(disk_dir, f".raw-{i}"), os.path.join(disk_dir, f"raw-{i}")
            with open(tmp, "wb") as f:
                f.write(payload)
            os.replace(tmp, path)
    else:
        import redis

        client = redis.Redis.from_url(redis_url)
        for i in range(num_chunks):
            client.set(f"raw-{i}", payload)
    return num_chunks * len(payload) / (time.perf_counter() - start) / 1e9


def measure_stores(disk_dir: str, redis_url: str, num_chunks: int) -> dict[str, tuple[float, float]]:
    results = {}
    for tier, config in (("cpu", {"cpu_bytes": "2GiB"}), ("disk", {"disk_dir": disk_dir}),
                         ("redis", {"remote_url": redis_url})):
        llm = offload_llm(**config)
        os.sync()  # each side starts without dirty pages left by the other to write back
        store_gbps = store_throughput(llm, num_chunks)
        payload = os.urandom(connector(llm).worker.store.payload_bytes)
        os.sync()
        results[tier] = (store_gbps, raw_throughput(tier, payload, num_chunks, disk_dir, redis_url))
        close(llm)
        print(f"  store {tier}: {results[tier][0]:.2f} GB/s, raw {results[tier][1]:.2f} GB/s", flush=True)
    return results


def decode_itl(llm: LLM, num_tokens: int, store_each_step: bool) -> float:
    """Median seconds between output tokens of one request; optionally one chunk stored per step."""
    engine, worker = llm.engine, connector(llm).worker
    blocks = list(range(CHUNK_TOKENS // engine.config.cache.block_size))
    original = worker.wait_for_save

    def wait_for_save_with_store(meta: Any) -> None:
        original(meta)
        worker.background.copy_out([ChunkSave("bench", f"{random.getrandbits(160):040x}", blocks)])
    worker.wait_for_save = wait_for_save_with_store if store_each_step else original
    engine.add_request({"prompt_token_ids": list(range(1000, 1100))},
                       SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    stamps = []
    while engine.has_unfinished_requests():
        if engine.step():
            stamps.append(time.perf_counter())
    worker.wait_for_save = original
    engine.run_until_idle(timeout_s=600)
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]  # skip the prefill
    return statistics.median(gaps)


def drain(llm: LLM) -> dict[str, float]:
    """Wait until every queued store is written and reported; return (and reset) the stats."""
    assert connector(llm).worker.background.wait_idle(600)
    # A step hands the writer's stats over (the stress run's stores bypass the scheduler, which
    # therefore does not know to wait for them: step once explicitly).
    llm.engine.step()
    llm.engine.run_until_idle(timeout_s=600)
    return llm.engine.scheduler.connector.take_stats()


def decode_itl_beside_prefills(llm: LLM, num_tokens: int, stores_on: bool, seed: int,
                               prompt_len: int = 2 * CHUNK_TOKENS) -> tuple[float, dict[str, float]]:
    """Median seconds between output tokens of one decoding request while other requests keep
    arriving and prefilling (one at a time, fresh prompts of `prompt_len`, so every full chunk they
    compute is stored). `stores_on=False` runs the same workload with the copy-out switched off.
    Returns (median ITL, the store stats of the run: chunks stored and dropped, seconds queued)."""
    engine, background = llm.engine, connector(llm).worker.background
    original = background.copy_out
    if not stores_on:
        background.copy_out = lambda saves: None
    rng = random.Random(seed)
    drain(llm)  # nothing from an earlier run is still being written, counting starts at zero
    decode_prompt = [rng.randrange(100, 40000) for _ in range(100)]
    itl = decode_itl_beside(engine, num_tokens, decode_prompt,
                            lambda: [rng.randrange(100, 40000) for _ in range(prompt_len)])
    background.copy_out = original
    return itl, drain(llm)


def decode_itl_beside(engine: Any, num_tokens: int, decode_prompt: list[int],
                      next_prompt: Callable[[], list[int] | None]) -> float:
    """Median seconds between output tokens of one decoding request while other requests arrive
    one at a time (`next_prompt()`, None once there are no more), each asking for one token."""
    engine.add_request({"prompt_token_ids": decode_prompt},
                       SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True),
                       request_id="decode")
    stamps: list[float] = []
    other_in_flight = False
    while engine.has_unfinished_requests():
        if not other_in_flight and len(stamps) < num_tokens and (prompt := next_prompt()) is not None:
            engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0.0))
            other_in_flight = True
        for out in engine.step():
            if out.request_id == "decode":
                stamps.append(time.perf_counter())
            elif out.finished:
                other_in_flight = False
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]  # skip the prefill
    return statistics.median(gaps)


@dataclass
class ItlResult:
    alone: float  # median decode ITL, nothing else running
    stressed: float  # ... with one chunk stored per step (synthetic)
    per_chunk_copy_out: float
    mixed_off: float  # median decode ITL beside a stream of prefills, stores off
    mixed_on: float  # ... the same workload with stores on
    mixed_chunks: int  # chunks stored during the stores-on runs, all together
    mixed_dropped: int  # ... and dropped (the staging pool was full: the writer fell behind)
    mixed_store_seconds: float  # mean seconds from copy-out to written, per stored chunk


def measure_itl(disk_dir: str, redis_url: str, num_tokens: int) -> ItlResult:
    llm = offload_llm(cpu_bytes="2GiB", disk_dir=disk_dir, remote_url=redis_url)
    decode_itl(llm, 8, False)  # warm-up
    alone = decode_itl(llm, num_tokens, False)
    drain(llm)
    stressed = decode_itl(llm, num_tokens, True)
    copy_out = drain(llm)
    num_chunks = max(1, copy_out.get("offload_chunks_stored", 1))
    per_chunk = copy_out.get("offload_copy_out_seconds", 0.0) / num_chunks
    # Off and on alternate (off, on, on, off, off, on) so that drift in the machine's speed cancels.
    runs: dict[bool, list[float]] = {False: [], True: []}
    totals = {"offload_chunks_stored": 0.0, "offload_stores_dropped": 0.0, "offload_store_seconds": 0.0}
    for i, stores_on in enumerate((False, True, True, False, False, True)):
        itl, stats = decode_itl_beside_prefills(llm, num_tokens // 2, stores_on, seed=100 + i)
        runs[stores_on].append(itl)
        for key in totals:
            totals[key] += stats.get(key, 0.0)
        print(f"  beside prefills, stores {'on' if stores_on else 'off'}: ITL {itl * 1e3:.0f} ms, "
              f"{stats.get('offload_chunks_stored', 0):.0f} chunks stored, "
              f"{stats.get('offload_stores_dropped', 0):.0f} dropped", flush=True)
    close(llm)
    stored = int(totals["offload_chunks_stored"])
    return ItlResult(alone, stressed, per_chunk, statistics.mean(runs[False]), statistics.mean(runs[True]),
                     stored, int(totals["offload_stores_dropped"]),
                     totals["offload_store_seconds"] / max(1, stored))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 3280, 4096],
                        help="prompt lengths; keep one that is not a multiple of chunk_tokens (256)")
    parser.add_argument("--store-chunks", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--parts", nargs="+", choices=["ttft", "store", "itl"],
                        default=["ttft", "store", "itl"])
    parser.add_argument("--plot", type=Path, default=Path("docs/benchmarks/bench_offload.png"),
                        help="where the TTFT / ITL plot goes (written when the ttft part ran)")
    args = parser.parse_args()
    torch.manual_seed(0)
    proc, redis_url = start_redis()
    mooncake = MooncakeStoreForBench() if mooncake_loads() and "ttft" in args.parts else None
    workdir = tempfile.mkdtemp(prefix="kvrelay-bench-offload-")
    try:
        ttfts: dict[tuple[str, int], float] = {}
        stores: dict[str, tuple[float, float]] = {}
        itl: ItlResult | None = None
        if "ttft" in args.parts:
            print("TTFT ...", flush=True)
            ttfts = measure_ttft(args.lengths, os.path.join(workdir, "kv"), redis_url,
                                 mooncake.url() if mooncake else None)
        if "store" in args.parts:
            print("stores ...", flush=True)
            stores = measure_stores(os.path.join(workdir, "store"), redis_url, args.store_chunks)
        if "itl" in args.parts:
            print("decode ITL ...", flush=True)
            itl = measure_itl(os.path.join(workdir, "itl"), redis_url, args.decode_tokens)
    finally:
        proc.terminate()
        if mooncake is not None:
            mooncake.close()
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(args.lengths, ttfts, stores, itl)
    if ttfts:
        plot(args.lengths, ttfts, itl, args.plot)


def plot(lengths: list[int], ttfts: dict[tuple[str, int], float], itl: ItlResult | None, path: Path) -> None:
    """Left: TTFT per prompt length, cold against warm from each tier (log scale). Right, when the
    ITL part ran: the decode's median inter-token latency beside prefills, stores off and on."""
    plt = plotting.pyplot(path)
    if plt is None:
        return

    tiers = [t for t in ("cold", "cpu", "disk", "redis", "mooncake") if (t, lengths[0]) in ttfts]
    fig, axes = plt.subplots(1, 2 if itl else 1, figsize=(11 if itl else 6, 4.2), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / len(tiers)
    for i, tier in enumerate(tiers):
        xs = [j + (i - (len(tiers) - 1) / 2) * width for j in range(len(lengths))]
        ax.bar(xs, [ttfts[(tier, n)] for n in lengths], width, label=tier)
    ax.set_xticks(range(len(lengths)), [f"{n} tokens" for n in lengths])
    ax.set_yscale("log")
    ax.set_ylabel("TTFT, s (log)")
    ax.set_title("time to first token: recompute vs load from a tier")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    if itl:
        ax = axes[0][1]
        ax.bar(["stores off", "stores on"], [itl.mixed_off * 1e3, itl.mixed_on * 1e3], color=["grey", "C1"])
        ax.axhline(itl.mixed_off * 1.1e3, linestyle="--", color="red", label="target: +10%")
        ax.set_ylabel("median ITL, ms")
        ax.set_title(f"decode beside {2 * CHUNK_TOKENS}-token prefills (3 runs each)")
        ax.legend(fontsize=8)
    plotting.save(plt, fig, "OffloadConnector, SmolLM2-135M fp32, 2 CPU cores, Redis on loopback", path)


def print_table(lengths: list[int], ttfts: dict[tuple[str, int], float],
                stores: dict[str, tuple[float, float]], itl: ItlResult | None) -> None:
    targets = {"cpu": 20, "disk": 10, "redis": 5, "mooncake": 5}
    targets = {tier: target for tier, target in targets.items() if (tier, lengths[0]) in ttfts}
    print(cpu_summary())
    if ttfts:
        print_ttft(lengths, ttfts, targets)
    if stores:
        print("\nstore throughput (GB/s of KV payload)")
        print(f"{'tier':>6} {'store':>7} {'raw':>7} {'ratio':>6}  raw: memcpy / file write+rename / SET")
        for tier, (store, raw) in stores.items():
            print(f"{tier:>6} {store:>7.2f} {raw:>7.2f} {store / raw:>6.2f}")
    if itl is not None:
        rise = (itl.mixed_on / itl.mixed_off - 1) * 100
        stress = (itl.stressed / itl.alone - 1) * 100
        print("\ndecode inter-token latency (median) of one request")
        print(f"  beside a stream of {2 * CHUNK_TOKENS}-token prefills: "
              f"stores off {itl.mixed_off * 1e3:.0f} ms, stores on {itl.mixed_on * 1e3:.0f} ms "
              f"({itl.mixed_chunks} chunks stored, {itl.mixed_dropped} dropped, "
              f"{itl.mixed_store_seconds:.1f} s from copy-out to written): {rise:+.1f}% "
              f"(target <= +10%: {'yes' if rise <= 10 else 'NO'})")
        print(f"  stress, no target: alone {itl.alone * 1e3:.1f} ms, with one chunk stored per decode step "
              f"{itl.stressed * 1e3:.1f} ms: {stress:+.1f}% (far more chunks than this instance computes); "
              f"copy-out {itl.per_chunk_copy_out * 1e3:.2f} ms per chunk inside the step")


def print_ttft(lengths: list[int], ttfts: dict[tuple[str, int], float], targets: dict[str, int]) -> None:
    print(f"\nTTFT (SmolLM2-135M fp32 CPU, {os.cpu_count()} cores, chunk_tokens={CHUNK_TOKENS})")
    print(f"{'prompt':>7} {'tier':>8} {'TTFT s':>8} {'speed-up':>9} {'target':>7}  ok")
    for n in lengths:
        cold = ttfts[("cold", n)]
        print(f"{n:>7} {'cold':>8} {cold:>8.3f}")
        for tier, target in targets.items():
            t = ttfts[(tier, n)]
            ok = "yes" if cold / t >= target else "NO"
            print(f"{n:>7} {tier:>8} {t:>8.3f} {cold / t:>8.1f}x {target:>6}x  {ok}")


if __name__ == "__main__":
    main()

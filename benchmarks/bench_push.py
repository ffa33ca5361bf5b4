"""The KV transfer left on the critical path: from P's last layer computed to D holding the whole
prompt's KV, for a layer-wise push, a push after prefill (vLLM's NixlPushConnector design) and a
pull (NixlConnector), over NIXL and TCP, in one run; and TTFT through `kvrelay up` against one
instance.

    .venv/bin/python benchmarks/bench_push.py                  # 1k, 4k, 8k tokens; both backends
    .venv/bin/python benchmarks/bench_push.py --tokens 1024 4096 --reps 2 --ttft 1024 4096

Setup: the default model (SmolLM2-135M-Instruct, fp32, 30 layers, 3 KV heads of 64: 46 KB of KV
per token), P and D engines each in its own process (`--threads` torch threads each, 1 by
default: `kvrelay up`'s split of two cores), stepped as a server's engine loop would (an idle
engine waits IDLE_STEP_SLEEP_S for a command between steps). P computes the prompt with
the default token budget (2048 a step, so a 4k prompt is two chunks and an 8k one four). Every
request has a prompt no engine has seen (the first token differs), so nothing is a prefix hit.

    push      D admits the request and registers its blocks before P is given it (what the proxy
              aims for by sending D's leg first); P computes the prompt.
    pull      P computes the prompt; when its answer (the params) is out, D is given the request
              and reads the blocks.
Clock: P's last layer computed = the moment P's last attention layer calls save_kv_layer in the
step that completes the prompt; D holding the KV = the step in which D's connector reports the
request in finished_recving (checksums verified). Both read time.monotonic() (CLOCK_MONOTONIC,
one clock for every process of the machine). In a pull, P's params reach D through this
process's pipes (the proxy's HTTP hop is left out, in the pull's favour). Modes alternate
within each prompt size, so a noisy neighbour hits all three alike.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.hostinfo import cpu_summary  # noqa: E402
from kvrelay.engine.llm import LLM  # noqa: E402
from kvrelay.engine.llm_engine import IDLE_STEP_SLEEP_S  # noqa: E402
from kvrelay.kv_transfer.transport import nixl_installed  # noqa: E402
from kvrelay.sampling_params import SamplingParams  # noqa: E402

MODES = ("push layer-wise", "push after prefill", "pull")
TARGET = 0.20  # layer-wise push <= 20% of pull's critical-path transfer at 4k tokens


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(conn: Any, kv_transfer_config: dict[str, Any], kv_cache_memory: str, threads: int) -> None:
    """One engine in its own process, stepped as a server's loop would, answering commands
    between steps; reports each finished request with the clock reading the measurement needs."""
    import torch

    torch.set_num_threads(threads)
    engine = LLM(kv_cache_memory=kv_cache_memory, kv_transfer_config=kv_transfer_config).engine
    connector = engine.runner.connector
    clocks = {"last_layer_at": 0.0}
    held_at: dict[str, float] = {}
    last_layer = connector.kv_spec.layer_names[-1]
    save, get_finished = connector.save_kv_layer, connector.get_finished

    def timed_save(layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        if layer_name == last_layer:
            clocks["last_layer_at"] = time.monotonic()  # before the connector's own work
        save(layer_name, kv_layer, attn_metadata)

    def timed_get_finished(finished_req_ids: set[str]) -> Any:
        output = get_finished(finished_req_ids)
        for req_id in output.finished_recving:
            held_at[req_id] = time.monotonic()
        return output

    connector.save_kv_layer, connector.get_finished = timed_save, timed_get_finished
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    conn.send(("ready",))
    while True:
        busy = engine.has_pending_work()
        if conn.poll(0 if busy else IDLE_STEP_SLEEP_S):
            command, *args = conn.recv()
            if command == "add":
                rid, tokens, params = args
                engine.add_request({"prompt_token_ids": tokens}, one, rid, kv_transfer_params=params)
            elif command == "registered":
                sender = connector.worker.sender
                conn.send(("registered", args[0] in sender._waiting or args[0] in sender._jobs))
            elif command == "stop":
                engine.shutdown()
                conn.send(("stopped",))
                return
            continue
        if busy:
            for out in engine.step():
                if out.finished:
                    clock = held_at.pop(out.request_id, None) or clocks["last_layer_at"]
                    conn.send(("finished", out.request_id, out.kv_transfer_params, out.error, clock))


class EngineProcess:
    def __init__(self, kv_transfer_config: dict[str, Any], kv_cache_memory: str, threads: int) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, kv_transfer_config, kv_cache_memory, threads),
                                   daemon=True)
        self.process.start()
        self._finished: dict[str, tuple[Any, ...]] = {}
        self._expect("ready")

    def _expect(self, kind: str, timeout_s: float = 900) -> tuple[Any, ...]:
        deadline = time.monotonic() + timeout_s
        while True:
            while not self._conn.poll(0.001):
                if time.monotonic() > deadline or not self.process.is_alive():
                    alive = self.process.is_alive()
                    raise RuntimeError(f"no {kind!r} from the engine process (alive: {alive})")
            message = self._conn.recv()
            if message[0] == "finished":
                self._finished[message[1]] = message[2:]
            if message[0] == kind:
                return tuple(message[1:])

    def add(self, rid: str, tokens: list[int], params: dict[str, Any]) -> None:
        self._conn.send(("add", rid, tokens, params))

    def registered(self, transfer_id: str) -> bool:
        self._conn.send(("registered", transfer_id))
        return bool(self._expect("registered")[0])

    def wait(self, rid: str) -> tuple[Any, ...]:
        """(kv_transfer_params, error, clock) of a finished request."""
        while rid not in self._finished:
            self._expect("finished")
        return self._finished.pop(rid)

    def close(self) -> None:
        if self.process.is_alive():
            self._conn.send(("stop",))
            self._expect("stopped", 60)
        self.process.join(timeout=30)


class Pair:
    """A P and a D engine process for one mode."""

    def __init__(self, mode: str, backend: str, kv_cache_memory: str, threads: int) -> None:
        self.mode = mode
        self.p_port = _free_port()
        name = "NixlConnector" if mode == "pull" else "NixlPushConnector"
        extra: dict[str, Any] = {"backend": backend}
        if mode == "push after prefill":
            extra["layerwise"] = False

        def config(role: str, port: int) -> dict[str, Any]:
            return {"kv_connector": name, "kv_role": role, "kv_ip": "127.0.0.1", "kv_port": port,
                    "kv_connector_extra_config": extra}

        self.p = EngineProcess(config("kv_producer", self.p_port), kv_cache_memory, threads)
        self.d = EngineProcess(config("kv_consumer", _free_port()), kv_cache_memory, threads)

    def run(self, rid: str, tokens: list[int]) -> float:
        """One request; returns the critical-path transfer in seconds."""
        if self.mode == "pull":
            self.p.add(f"p-{rid}", tokens, {"do_remote_decode": True, "do_remote_prefill": False})
            params, _, last_layer_at = self.p.wait(f"p-{rid}")
            self.d.add(rid, tokens, params)
        else:
            self.d.add(rid, tokens, {"do_remote_prefill": True, "transfer_mode": "push",
                                     "remote_request_id": f"t-{rid}", "remote_host": "127.0.0.1",
                                     "remote_port": self.p_port})
            deadline = time.monotonic() + 30
            while not self.p.registered(f"t-{rid}"):  # D's leg first, as the proxy sends it
                if time.monotonic() > deadline:
                    raise TimeoutError(f"D's registration for {rid} did not reach P")
                time.sleep(0.001)
            self.p.add(f"p-{rid}", tokens, {"do_remote_decode": True, "transfer_mode": "push",
                                            "transfer_id": f"t-{rid}"})
            _, _, last_layer_at = self.p.wait(f"p-{rid}")
        _, error, held_at = self.d.wait(rid)
        if error or not held_at or held_at == last_layer_at:
            raise RuntimeError(f"{self.mode}: request {rid} was not served from P's KV: {error}")
        return float(held_at - last_layer_at)

    def close(self) -> None:
        self.p.close()
        self.d.close()


def prompt_token_ids(num_tokens: int, first_token: int) -> list[int]:
    return [first_token] + [100 + (i * 7919) % 40_000 for i in range(num_tokens - 1)]


def bench(backends: list[str], sizes: list[int], reps: int, kv_cache_memory: str,
          threads: int) -> dict[tuple[str, str, int], list[float]]:
    results: dict[tuple[str, str, int], list[float]] = {}
    first_tokens = itertools.count(200)
    for backend in backends:
        pairs = {mode: Pair(mode, backend, kv_cache_memory, threads) for mode in MODES}
        try:
            for mode, pair in pairs.items():  # warm-up off the clock: handshakes, lazy init
                pair.run(f"warm-{backend}-{mode}", prompt_token_ids(64, next(first_tokens)))
            for num_tokens, rep in itertools.product(sizes, range(reps)):
                for mode, pair in pairs.items():
                    seconds = pair.run(f"{backend}-{mode}-{num_tokens}-{rep}".replace(" ", "_"),
                                       prompt_token_ids(num_tokens, next(first_tokens)))
                    results.setdefault((backend, mode, num_tokens), []).append(seconds)
                    print(f"  {backend:>4} {mode:<18} {num_tokens:>5} tokens: {seconds * 1000:8.1f} ms",
                          flush=True)
        finally:
            for pair in pairs.values():
                pair.close()
    return results


def print_table(results: dict[tuple[str, str, int], list[float]], backends: list[str],
                sizes: list[int]) -> None:
    print(f"\n{cpu_summary()}")
    print("critical-path KV transfer (P's last layer computed -> D holds all KV), ms, median (min..max)")
    print(f"{'backend':>7} {'tokens':>6}  " + "  ".join(f"{m:>22}" for m in MODES)
          + f"  {'layer-wise/pull':>15}  {'after/pull':>10}")
    for backend, num_tokens in itertools.product(backends, sizes):
        cells = [results[(backend, mode, num_tokens)] for mode in MODES]
        medians = [statistics.median(c) for c in cells]
        text = "  ".join(f"{statistics.median(c) * 1000:8.1f} ({min(c) * 1000:.1f}..{max(c) * 1000:.1f})"
                         .rjust(22) for c in cells)
        print(f"{backend:>7} {num_tokens:>6}  {text}  {medians[0] / medians[2]:>15.3f}  "
              f"{medians[1] / medians[2]:>10.3f}")
    for backend in backends:
        near_4k = min(sizes, key=lambda n: abs(n - 4096))
        ratio = (statistics.median(results[(backend, MODES[0], near_4k)])
                 / statistics.median(results[(backend, MODES[2], near_4k)]))
        print(f"{backend}: layer-wise push / pull at {near_4k} tokens = {ratio:.3f} (target <= {TARGET}): "
              f"{'met' if ratio <= TARGET else 'NOT met'}")


def bench_ttft(sizes: list[int], reps: int) -> None:
    """TTFT through `kvrelay up` with the push connector and with the pull one, against one
    `kvrelay serve` with all the threads; one target at a time."""
    from benchmarks.transfer_ttft import TARGET as TTFT_TARGET
    from benchmarks.transfer_ttft import measure_ttfts
    from kvrelay.disagg.launcher import ClusterSpec, LocalCluster, available_cores, single_instance

    total = available_cores()
    first_tokens = itertools.count(5000)
    ttfts: dict[str, dict[int, list[float]]] = {}
    for connector in ("NixlPushConnector", "NixlConnector"):
        spec = ClusterSpec(port=0, connector=connector, threads_per_instance=max(1, total // 2))
        with LocalCluster(spec) as cluster:
            ttfts[connector] = measure_ttfts(cluster.url, sizes, reps, first_tokens)
    with single_instance(None, total) as single:
        ttfts["single"] = measure_ttfts(single.url, sizes, reps, first_tokens)
    print(f"\nTTFT in ms through kvrelay up (1P1D, {max(1, total // 2)} thread(s) each) against one "
          f"kvrelay serve ({total} threads), median of {reps}")
    print(f"{'prompt':>7} {'push up':>9} {'pull up':>9} {'single':>9} {'push/single':>12} {'pull/single':>12}"
          f"  target <= {TTFT_TARGET}")
    for n in sizes:
        push, pull, alone = (statistics.median(ttfts[k][n]) for k in ("NixlPushConnector", "NixlConnector",
                                                                      "single"))
        print(f"{n:>7} {push * 1000:>9.0f} {pull * 1000:>9.0f} {alone * 1000:>9.0f} {push / alone:>12.2f} "
              f"{pull / alone:>12.2f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[1024, 4096, 8000],
                        help="prompt sizes of the critical-path table (none: only the TTFT part)")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--backends", nargs="+", default=["tcp", "nixl"] if nixl_installed() else ["tcp"])
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine process")
    parser.add_argument("--ttft", type=int, nargs="*", default=None,
                        help="also TTFT through kvrelay up for these prompt sizes (e.g. 1024 4096)")
    parser.add_argument("--ttft-reps", type=int, default=1)
    args = parser.parse_args(argv)
    if args.tokens:
        results = bench(args.backends, args.tokens, args.reps, args.kv_cache_memory, args.threads)
        print_table(results, args.backends, args.tokens)
    if args.ttft:
        bench_ttft(args.ttft, args.ttft_reps)


if __name__ == "__main__":
    main()

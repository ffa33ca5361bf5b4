"""How much slower an instance computes while another one computes on the same machine.

`kvrelay up` runs its P and D instances side by side, each on its share of the cores. They do
not take each other's cores, but they share the last-level cache and the memory bandwidth, and a
profile taken alone cannot see what that costs. On the 2-core AMD VM it turned out small
(1.00-1.07 in two runs, docs/benchmarks/planner.md); timing the alone steps first and the crowded ones
after had said 1.02-1.15, which was the machine's speed drifting in between.

`measure_co_run` times a few prefill cases with a neighbour process decoding (what a P instance
sees while its D works) and a few decode cases with a neighbour prefilling (what a D sees). The
neighbour is the same engine configuration in a child process (`python -m
kvrelay.disagg.planner.corun CONFIG`), stepping until it is stopped or its parent goes away.
Steps alone and beside it alternate, the neighbour paused (SIGSTOP) for the alone ones, so a
drift in the machine's speed lands on both sides alike. The slowdown per kind is the median
over the cases of the ratio of their medians, at least 1 (a neighbour cannot make a step
faster; a ratio under 1 is noise), and the simulator applies it while another instance on the
shared host is computing (`SimOptions.shared_host`).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

NEIGHBOUR_DECODE_BATCH = 4
NEIGHBOUR_CONTEXT = 256
NEIGHBOUR_PREFILL_TOKENS = 512
READY = "co-run neighbour ready"


@dataclass(frozen=True)
class CoRunCases:
    prefill_tokens: tuple[int, ...]  # one sequence each, no cached prefix
    decode_batches: tuple[int, ...]
    decode_context: int
    reps: int


def pick_cases(prefill_tokens: Sequence[int], decode_batch: Sequence[int], decode_context: Sequence[int],
               budget: int, reps: int) -> CoRunCases:
    """A few cases spanning the grid: the smallest, middle and largest prefill that fits the
    budget and decode batch sizes likewise, at the middle context."""
    def spread(values: Sequence[int]) -> tuple[int, ...]:
        ordered = sorted(set(values))
        return tuple(sorted({ordered[0], ordered[len(ordered) // 2], ordered[-1]})) if ordered else ()

    contexts = sorted(decode_context)
    return CoRunCases(spread([t for t in prefill_tokens if t <= budget]), spread(decode_batch),
                      contexts[len(contexts) // 2], max(3, reps))


def describe(slowdown: dict[str, float]) -> str:
    """A profile's co_run_slowdown in words, as the profiler and bench_planner print it."""
    factors = ", ".join(f"{kind} x{value:.2f}" for kind, value in sorted(slowdown.items()))
    return f"beside a busy neighbour instance, steps take {factors}"


def neighbour_config(engine: Any, threads: int) -> dict[str, Any]:
    cfg = engine.config
    return {"model": cfg.model.model, "dtype": cfg.model.dtype, "device": cfg.model.device,
            "max_model_len": cfg.model.max_model_len, "attention_backend": cfg.model.attention_backend,
            "enforce_eager": cfg.model.enforce_eager, "threads": threads,
            "block_size": cfg.cache.block_size, "kv_cache_memory": cfg.cache.kv_cache_memory,
            "cache_dtype": cfg.cache.cache_dtype, "num_blocks_override": cfg.cache.num_blocks_override,
            "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
            "max_num_seqs": cfg.scheduler.max_num_seqs}


class Neighbour:
    """A child process running the same engine, busy with steps of `kind` until stopped."""

    def __init__(self, config: dict[str, Any], kind: str, startup_timeout_s: float = 300.0) -> None:
        self.kind = kind
        cmd = [sys.executable, "-m", "kvrelay.disagg.planner.corun", json.dumps({**config, "kind": kind})]
        env = {**os.environ, "OMP_NUM_THREADS": str(config["threads"])}
        # NOTE: stderr to a file, not a pipe: a pipe nobody reads would fill and stop the neighbour
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, text=True, env=env)
        self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not lines or READY not in lines[0]:
            self._terminate()
            self._stderr.seek(0)
            err = self._stderr.read().strip().splitlines()
            self.stop()
            why = err[-1] if err else f"no sign of life within {timeout_s:.0f} s"
            raise RuntimeError(f"the co-run neighbour ({self.kind}) did not start: {why}")

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.resume()  # NOTE: a stopped process would not act on SIGTERM until continued
        self._terminate()
        for stream in (self.proc.stdin, self.proc.stdout, self._stderr):
            if stream is not None and not stream.closed:
                stream.close()

    def _terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Neighbour:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def measure_co_run(timer: Any, cases: CoRunCases, start_neighbour: Callable[[str], Any],
                   phase: Callable[[str], None] = lambda _: None
                   ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The slowdown per kind and the samples it came from: each case's steps alternate between
    the neighbour paused and busy (decoding while prefills are timed, prefilling while decodes
    are), `cases.reps` each way; a case's ratio is the ratio of the medians. `phase` is told
    what starts next (two phases)."""
    def prefill(tokens: int, neighbour: Any) -> tuple[list[float], list[float]]:
        alone, crowded = [], []
        for _ in range(cases.reps):
            neighbour.pause()
            alone.append(timer.prefill_ms([tokens], 0))
            neighbour.resume()
            crowded.append(timer.prefill_ms([tokens], 0))
        return alone, crowded

    def decode(batch: int, neighbour: Any) -> tuple[list[float], list[float]]:
        def before_step(i: int) -> None:
            (neighbour.pause if i % 2 == 0 else neighbour.resume)()

        steps = timer.decode_ms(batch, cases.decode_context, 2 * cases.reps, before_step)
        neighbour.resume()
        return [ms for _, ms in steps[0::2]], [ms for _, ms in steps[1::2]]

    plan: list[tuple[str, str, Callable[[int, Any], tuple[list[float], list[float]]], tuple[int, ...]]] = [
        ("prefill", "decode", prefill, cases.prefill_tokens),
        ("decode", "prefill", decode, cases.decode_batches)]
    samples: list[dict[str, Any]] = []
    slowdown: dict[str, float] = {}
    for kind, neighbour_kind, time_case, sizes in plan:
        if not sizes:
            continue
        phase(f"{kind} alone and beside a neighbour's {neighbour_kind}")
        ratios = []
        with start_neighbour(neighbour_kind) as neighbour:
            for size in sizes:
                alone, crowded = time_case(size, neighbour)
                samples.append({"kind": kind, "size": size, "neighbour": neighbour_kind,
                                "alone_ms": statistics.median(alone),
                                "co_run_ms": statistics.median(crowded)})
                ratios.append(samples[-1]["co_run_ms"] / samples[-1]["alone_ms"])
        slowdown[kind] = max(1.0, statistics.median(ratios))
    return slowdown, samples


# ----------------------------------------------------------------------------- the neighbour

def _exit_when_parent_goes() -> None:
    sys.stdin.read()  # EOF: the profiler closed the pipe or died
    os._exit(0)


def neighbour_main(config: dict[str, Any]) -> None:
    import torch

    from kvrelay.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from kvrelay.disagg.planner.step_timer import StepTimer
    from kvrelay.engine.llm_engine import LLMEngine

    threading.Thread(target=_exit_when_parent_goes, daemon=True).start()
    torch.set_num_threads(int(config["threads"]))
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=config["model"], dtype=config["dtype"], device=config.get("device", "auto"),
                          max_model_len=config.get("max_model_len"),
                          enforce_eager=config.get("enforce_eager", False),
                          attention_backend=config.get("attention_backend", "auto")),
        cache=CacheConfig(block_size=config["block_size"], kv_cache_memory=config["kv_cache_memory"],
                          cache_dtype=config["cache_dtype"],
                          num_blocks_override=config["num_blocks_override"]),
        scheduler=SchedulerConfig(max_num_seqs=config["max_num_seqs"],
                                  max_num_batched_tokens=config["max_num_batched_tokens"])))
    timer = StepTimer(engine, seed=1)
    prefill_tokens = min(NEIGHBOUR_PREFILL_TOKENS, int(config["max_num_batched_tokens"]))
    batch = min(NEIGHBOUR_DECODE_BATCH, int(config["max_num_seqs"]))
    context = max(1, min(NEIGHBOUR_CONTEXT, engine.max_model_len - 64))
    step = (lambda: timer.prefill_ms([prefill_tokens], 0)) if config["kind"] == "prefill" else \
        (lambda: timer.decode_ms(batch, context, 32))
    step()  # warm before saying ready, so the timed cases see a neighbour at full speed
    print(READY, flush=True)
    while True:
        step()


if __name__ == "__main__":
    neighbour_main(json.loads(sys.argv[1]))

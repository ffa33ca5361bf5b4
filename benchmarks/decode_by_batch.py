"""Decode step time against batch size on one engine: why the planner's profile keeps a table.

    .venv/bin/python benchmarks/decode_by_batch.py --threads 1 --rounds 4 --batches 1,2,3,4,6,8

One engine (the default model unless --model), pure decode steps of B sequences with --context
tokens each, the batch sizes taking turns for --rounds rounds (so a noisy neighbour hits them
alike). Per B: the median and best wall time and thread CPU time of a step, and the median wall
time against B=1's measured in the same run. Until 2026-12-02 the engine's linear layers
multiplied 1-2 rows by a split `bmm` and 3-512 rows by the native kernel
(kvrelay.model.layers.linear), so a step of 3 sequences could cost less than one of 1: no line
through (B, ms) describes that, which is what `decode_by_batch` in a profile is for. The native
kernel now takes 1-512 rows; the table stays, since a step's cost need not be a line anyway.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from hostinfo import cpu_summary  # noqa: E402

from kvrelay.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from kvrelay.disagg.planner.step_timer import StepTimer  # noqa: E402
from kvrelay.engine.llm_engine import LLMEngine  # noqa: E402
from kvrelay.sampling_params import SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=6, help="decode steps per batch and round")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batches", default="1,2,3,4,6,8")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if min(batches) < 1 or args.rounds < 1 or args.steps < 1:
        p.error("batches, --rounds and --steps must be >= 1")
    torch.set_num_threads(args.threads)
    config = EngineConfig(model=ModelConfig(model=args.model), cache=CacheConfig(kv_cache_memory=256 * 2**20),
                          scheduler=SchedulerConfig(max_num_seqs=max(64, *batches)))
    engine = LLMEngine(config)
    timer = StepTimer(engine)
    timer.decode_ms(1, 8, 2)  # warm-up: lazy initialisation, native kernel builds
    times: dict[int, list[tuple[float, float]]] = {b: [] for b in batches}
    for _ in range(args.rounds):
        for b in batches:
            times[b] += decode_steps(engine, timer, b, args.context, args.steps)
    assert engine.blocks_in_use == 0
    print(f"decode steps, {args.threads} thread(s), {args.context} tokens of context each, {args.rounds} "
          f"rounds x {args.steps} steps; {cpu_summary()}; the machine is shared: medians")
    base = statistics.median(w for w, _ in times[batches[0]])
    print(f"{'batch':>6}{'wall med ms':>13}{'wall best':>11}{'cpu med ms':>12}{'cpu best':>10}"
          f"{f'wall / B={batches[0]}':>13}")
    for b in batches:
        wall, cpu = [w for w, _ in times[b]], [c for _, c in times[b]]
        print(f"{b:>6}{statistics.median(wall):>13.1f}{min(wall):>11.1f}{statistics.median(cpu):>12.1f}"
              f"{min(cpu):>10.1f}{statistics.median(wall) / base:>13.2f}")
    return 0


def decode_steps(engine: LLMEngine, timer: StepTimer, batch: int, context: int,
                 steps: int) -> list[tuple[float, float]]:
    """(wall ms, thread CPU ms) of each pure decode step of `batch` fresh sequences."""
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True, temperature=0.0)
    for _ in range(batch):
        engine.add_request(timer.fresh(context), params)
    sched, out = engine.scheduler, []
    while sched.has_unfinished_requests():
        pure = (len(sched.running) == batch and not sched.waiting
                and all(r.num_tokens - r.num_computed_tokens == 1 for r in sched.running))
        wall, cpu = time.perf_counter(), time.thread_time()
        engine.step()
        if pure:
            out.append(((time.perf_counter() - wall) * 1e3, (time.thread_time() - cpu) * 1e3))
    return out


if __name__ == "__main__":
    sys.exit(main())

"""Timing engine steps of a chosen shape: what the profiler measures, and what its co-run
neighbour (corun.py) runs beside it."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any


class StepTimer:
    """Times engine steps of a chosen shape on one engine, with fresh random tokens each time so
    no sample hits the prefix cache another one filled (except the prefix it means to hit)."""

    def __init__(self, engine: Any, seed: int = 0) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.vocab = engine.spec.vocab_size

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(1, self.vocab) for _ in range(n)]

    def _params(self, max_tokens: int) -> Any:
        from kvrelay.sampling_params import SamplingParams
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)

    def _drain(self) -> None:
        while self.engine.scheduler.has_unfinished_requests():
            self.engine.step()

    def prefill_ms(self, tokens_per_seq: Sequence[int], prefix_tokens: int) -> float:
        prefix = self.fresh(prefix_tokens)
        if prefix_tokens:
            self.engine.add_request(prefix + self.fresh(1), self._params(1))
            self._drain()  # the prefix's full blocks are now in the prefix cache
        for n in tokens_per_seq:
            self.engine.add_request(prefix + self.fresh(n), self._params(1))
        start = time.perf_counter()
        self.engine.step()
        elapsed = (time.perf_counter() - start) * 1e3
        if self.engine.scheduler.has_unfinished_requests():
            raise ValueError(f"a prefill of {sum(tokens_per_seq)} tokens did not fit one step: raise "
                             "--max-num-batched-tokens or --kv-cache-memory, or shrink the grid")
        return elapsed

    def decode_ms(self, batch: int, context: int, steps: int,
                  before_step: Callable[[int], None] | None = None) -> list[tuple[int, float]]:
        """(total context, ms) of `steps` pure decode steps of `batch` sequences; `before_step`
        is called with each timed step's index just before it starts."""
        for _ in range(batch):
            self.engine.add_request(self.fresh(context), self._params(steps + 1))
        out: list[tuple[int, float]] = []
        sched = self.engine.scheduler
        while sched.has_unfinished_requests():
            pure = (len(sched.running) == batch and not sched.waiting
                    and all(r.num_tokens - r.num_computed_tokens == 1 for r in sched.running))
            total = sum(r.num_computed_tokens for r in sched.running)
            if pure and before_step is not None and len(out) < steps:
                before_step(len(out))
            start = time.perf_counter()
            self.engine.step()
            if pure:
                out.append((total, (time.perf_counter() - start) * 1e3))
        return out[:steps]

"""DistServe mode: DistServe's own latency model, batching and search (its README, data/distserve).

One prefill instance (TP tp_p) and one decode instance (TP tp_d), pipeline depth 1:
- prefill: whenever idle, FCFS whole requests while the batch's prompt tokens fit in
  max_num_tokens (the model's capacity at tp_p from max_num_tokens.csv); the first waiting
  request always goes, so a prompt longer than the limit runs alone instead of blocking;
- no KV transfer time: a request is in the decode queue the moment its prefill batch ends;
- decode: whenever idle, every queued request in queue order while the batch's total context
  stays within 50,000 tokens (at least one); after the step each request has one more token,
  finished ones leave, the rest go to the back of the queue;
- TTFT = prefill done - arrival; TPOT = (finish - prefill done) / output_len;
- a rate passes when p90 TTFT < ttft and p90 TPOT < tpot (strict);
- Poisson arrivals at per-GPU rate * (tp_p + tp_d); bisection on the per-GPU rate over
  [0, max_rate] until the interval is 0.25 wide; the goodput is its lower end.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvrelay.disagg.planner.profile import (
    DISTSERVE_DECODE_CONTEXT_LIMIT,
    DistServeCoeffs,
    distserve_decode_ms,
    distserve_prefill_ms,
)
from kvrelay.disagg.planner.sim import percentile
from kvrelay.disagg.planner.workload import poisson_arrivals

DISTSERVE_BISECT_WIDTH = 0.25


@dataclass
class _Req:
    arrival_ms: float
    input_len: int
    output_len: int
    counter: int = 0  # decode steps done
    prefill_done_ms: float = 0.0
    finish_ms: float = 0.0


@dataclass
class DistServeRun:
    ttft_ms: list[float]
    tpot_ms: list[float]


def simulate_distserve(arrivals_ms: Sequence[float], lengths: Sequence[tuple[int, int]],
                       prefill: DistServeCoeffs, decode: DistServeCoeffs, max_prefill_tokens: int,
                       decode_context_limit: int = DISTSERVE_DECODE_CONTEXT_LIMIT) -> DistServeRun:
    """One prefill and one decode instance under DistServe's rules; lengths are (input, output)."""
    reqs = [_Req(t, i, o) for t, (i, o) in zip(arrivals_ms, lengths, strict=True)]
    events: list[tuple[float, int, str, list[_Req]]] = []
    seq = itertools.count()
    p_queue: deque[_Req] = deque()
    d_queue: deque[_Req] = deque()
    busy = {"prefill": False, "decode": False}

    def start_prefill(now: float) -> None:
        if busy["prefill"] or not p_queue:
            return
        batch = [p_queue.popleft()]
        while p_queue and sum(r.input_len for r in batch) + p_queue[0].input_len <= max_prefill_tokens:
            batch.append(p_queue.popleft())
        busy["prefill"] = True
        done = now + distserve_prefill_ms(prefill, [r.input_len for r in batch])
        heapq.heappush(events, (done, next(seq), "prefill", batch))

    def start_decode(now: float) -> None:
        if busy["decode"] or not d_queue:
            return
        batch = [d_queue.popleft()]
        total = batch[0].input_len + batch[0].counter
        while d_queue and total + d_queue[0].input_len + d_queue[0].counter <= decode_context_limit:
            total += d_queue[0].input_len + d_queue[0].counter
            batch.append(d_queue.popleft())
        busy["decode"] = True
        done = now + distserve_decode_ms(decode, [r.input_len + r.counter for r in batch])
        heapq.heappush(events, (done, next(seq), "decode", batch))

    for r in reqs:
        heapq.heappush(events, (r.arrival_ms, next(seq), "arrive", [r]))
    while events:
        now = events[0][0]
        # NOTE: every event of one instant lands before any batch forms, so requests arriving
        # together can share a batch (independent of the order the heap yields them in).
        while events and events[0][0] == now:
            _, _, kind, batch = heapq.heappop(events)
            _apply(kind, batch, now, p_queue, d_queue, busy)
        start_prefill(now)
        start_decode(now)
    return DistServeRun([r.prefill_done_ms - r.arrival_ms for r in reqs],
                        [(r.finish_ms - r.prefill_done_ms) / r.output_len for r in reqs])


def _apply(kind: str, batch: list[_Req], now: float, p_queue: deque[_Req], d_queue: deque[_Req],
           busy: dict[str, bool]) -> None:
    if kind == "arrive":
        p_queue.extend(batch)
    elif kind == "prefill":
        busy["prefill"] = False
        for r in batch:
            r.prefill_done_ms = now
        d_queue.extend(batch)
    else:
        busy["decode"] = False
        for r in batch:
            r.counter += 1
            if r.counter >= r.output_len:
                r.finish_ms = now
            else:
                d_queue.append(r)


@dataclass(frozen=True)
class DistServeSLO:
    ttft_ms: float = 200.0
    tpot_ms: float = 100.0
    percentile: float = 90.0

    def passes(self, run: DistServeRun) -> bool:
        return (percentile(run.ttft_ms, self.percentile) < self.ttft_ms
                and percentile(run.tpot_ms, self.percentile) < self.tpot_ms)


@dataclass
class DistServeConfig:
    tp_prefill: int
    tp_decode: int
    per_gpu_rate: float = 0.0
    tried: list[tuple[float, bool]] = field(default_factory=list)  # (per-GPU rate, passed)

    @property
    def num_gpus(self) -> int:
        return self.tp_prefill + self.tp_decode


def distserve_goodput(lengths: Sequence[tuple[int, int]], prefill: DistServeCoeffs, decode: DistServeCoeffs,
                      config: DistServeConfig, max_prefill_tokens: int, slo: DistServeSLO,
                      max_rate: float, seed: int = 0) -> DistServeConfig:
    """Bisect the per-GPU rate in [0, max_rate] down to a 0.25-wide interval (DistServe's search)."""
    lo, hi = 0.0, max_rate
    while hi - lo > DISTSERVE_BISECT_WIDTH:
        mid = (lo + hi) / 2
        times_s = poisson_arrivals(len(lengths), mid * config.num_gpus, seed)
        run = simulate_distserve([t * 1e3 for t in times_s], lengths, prefill, decode, max_prefill_tokens)
        ok = slo.passes(run)
        config.tried.append((mid, ok))
        lo, hi = (mid, hi) if ok else (lo, mid)
    config.per_gpu_rate = lo
    return config

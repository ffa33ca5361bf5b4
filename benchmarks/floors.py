"""Lower bounds on the offline benchmark's rows from the work they contain and this host's speed.

A ratio target against another engine is only reachable if the time it implies is above what
the work needs on this host at the very best. These floors are deliberately optimistic, so a
target under them is out of reach for any implementation of the same fp32 arithmetic:

- compute floor of a workload: the FLOPs it cannot avoid (every weight matmul of every prompt
  and generated token, the LM head for each sampled row only, causal attention over the context)
  at the best fp32 matmul rate measured here (torch's `F.linear` on the model's own weight shapes
  at several row counts, the fastest single pass of any), as if every FLOP ran at that rate;
- bandwidth floor of single-stream decode: each step reads every weight once, at the best
  streaming read rate measured here (a reduction over a buffer the size of the weights).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvrelay.model.spec import ModelSpec


@dataclass(frozen=True)
class Floor:
    seconds: float
    work: float  # FLOPs or bytes
    rate: float  # FLOP/s or B/s, the best measured
    how: str  # what the rate is


def _weights_per_token(spec: ModelSpec) -> int:
    h, q, kv, inter = (spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim,
                       spec.intermediate_size)
    return spec.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)


def workload_flops(spec: ModelSpec, reqs: Sequence[tuple[int, int]]) -> float:
    """FLOPs of serving `reqs` ((prompt tokens, output tokens) each) with no prefix reuse: every
    prompt token and every generated token but the last goes through the layers, each output
    token is sampled from one LM-head row, attention is causal (QK^T and PV)."""
    per_token = 2.0 * _weights_per_token(spec)
    lm_head = 2.0 * spec.hidden_size * spec.vocab_size
    attn = 4.0 * spec.num_layers * spec.num_heads * spec.head_dim  # per (query, key) pair
    total = 0.0
    for prompt, output in reqs:
        forwarded = prompt + output - 1  # the last sampled token is never fed back
        total += forwarded * per_token + output * lm_head + attn * forwarded * (forwarded + 1) / 2
    return total


def _best_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def best_matmul_rate(spec: ModelSpec, rows: Sequence[int] = (128, 256, 512, 1024, 2048),
                     reps: int = 5) -> float:
    """The fastest fp32 FLOP/s of one `F.linear` pass over the model's four per-layer weight shapes
    (qkv, o, gate_up, down) at any of `rows`."""
    h, q, kv, inter = (spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim,
                       spec.intermediate_size)
    weights = [torch.randn(q + 2 * kv, h), torch.randn(h, q), torch.randn(2 * inter, h),
               torch.randn(h, inter)]
    best = 0.0
    for n in rows:
        xs = [torch.randn(n, w.shape[1]) for w in weights]
        flops = 2.0 * n * sum(w.numel() for w in weights)

        def one_pass(xs: list[torch.Tensor] = xs) -> None:
            for x, w in zip(xs, weights, strict=True):
                torch.nn.functional.linear(x, w)

        best = max(best, flops / _best_seconds(one_pass, reps))
    return best


def compute_floor(spec: ModelSpec, reqs: Sequence[tuple[int, int]]) -> Floor:
    flops = workload_flops(spec, reqs)
    rate = best_matmul_rate(spec)
    return Floor(flops / rate, flops, rate,
                 "best fp32 F.linear pass over the model's weight shapes, 128-2048 rows")


def bandwidth_floor(spec: ModelSpec, tokens: int, reps: int = 5) -> Floor:
    """`tokens` single-stream decode steps, each reading every weight (the LM head included) once."""
    weight_bytes = 4.0 * (_weights_per_token(spec) + spec.hidden_size * spec.vocab_size)
    buffer = torch.ones(int(weight_bytes // 4))
    rate = weight_bytes / _best_seconds(lambda: buffer.sum(), reps)
    return Floor(tokens * weight_bytes / rate, tokens * weight_bytes, rate,
                 "best streaming read (a sum over a buffer the size of the fp32 weights)")

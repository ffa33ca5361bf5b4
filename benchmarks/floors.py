"""Lower bounds on the offline benchmark's rows from the work they contain and this host's speed.

A ratio target against another engine is reachable only if the time it implies is above what
the work needs on this host at the very best. Both floors are optimistic on purpose:

- compute floor of a workload: the FLOPs no float32 implementation can avoid (every weight matmul
  of every prompt token and fed-back output token, the LM head for each sampled row only, causal
  attention over the context) at this CPU's peak FMA rate, measured by `fma_peak.c` (register-only
  vector FMAs on every thread, nothing read from memory), as if every FLOP ran at that rate;
- bandwidth floor of single-stream decode: each step reads every weight once, at the best
  streaming read rate measured here (a reduction over a buffer the size of the weights; a better
  read may beat it a little, so this one is an estimate, not a proof).
"""

from __future__ import annotations

import ctypes
import os
import shlex
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

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


def fma_peak(threads: int, reps: int = 7) -> float | None:
    """The best of `reps` runs of `fma_peak.c` on `threads` threads, in FLOP/s; None without a C
    compiler."""
    here = Path(__file__).resolve().parent
    with tempfile.TemporaryDirectory() as tmp:
        lib = Path(tmp) / "fma_peak.so"
        command = [*shlex.split(os.environ.get("CC") or "cc"), "-O3", "-march=native", "-fopenmp",
                   "-shared", "-fPIC", f"-I{here.parent / 'kvrelay' / 'kernels'}", str(here / "fma_peak.c"),
                   "-o", str(lib)]
        try:
            subprocess.run(command, check=True, capture_output=True)
        except FileNotFoundError:
            return None
        fn = ctypes.CDLL(str(lib)).fma_peak
        fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_int64, ctypes.c_int]
        return max(fn(10_000_000, threads) for _ in range(reps))


def compute_floor(spec: ModelSpec, reqs: Sequence[tuple[int, int]], threads: int) -> Floor | None:
    flops = workload_flops(spec, reqs)
    rate = fma_peak(threads)
    if rate is None:
        return None
    return Floor(flops / rate, flops, rate, f"peak FMA rate of {threads} threads, fma_peak.c")


def bandwidth_floor(spec: ModelSpec, tokens: int, reps: int = 5) -> Floor:
    """`tokens` single-stream decode steps, each reading every weight (the LM head included) once."""
    weight_bytes = 4.0 * (_weights_per_token(spec) + spec.hidden_size * spec.vocab_size)
    buffer = torch.ones(int(weight_bytes // 4))
    rate = weight_bytes / _best_seconds(lambda: buffer.sum(), reps)
    return Floor(tokens * weight_bytes / rate, tokens * weight_bytes, rate,
                 "best streaming read (a sum over a buffer the size of the fp32 weights)")


def notes(spec: ModelSpec, threads: int, *, single_tokens: int, single_vllm: float | None,
          mixed: Sequence[tuple[int, int]], mixed_vllm: float | None) -> list[str]:
    """bench_offline's lines under its table: how fast its single-stream row (`single_tokens`
    decode steps; 0: not measured) and mixed row (`mixed`: (prompt, output) tokens per request;
    empty: not measured) could be on this host at the very best, and the ratio against vLLM's
    measured tok/s that would allow."""
    lines = []
    if single_tokens:
        f = bandwidth_floor(spec, single_tokens)
        best = single_tokens / f.seconds
        vs = f", {best / single_vllm:.2f}x vLLM" if single_vllm else ""
        lines.append(f"single-stream floor: {single_tokens} steps x {f.work / single_tokens / 1e6:.0f} MB of "
                     f"weights at {f.rate / 1e9:.1f} GB/s ({f.how}): at most {best:.1f} tok/s{vs}")
    if mixed:
        floor = compute_floor(spec, mixed, threads)
        if floor is None:
            return [*lines, "mixed-workload floor: not measured (no C compiler)"]
        best = sum(p + o for p, o in mixed) / floor.seconds
        vs = f", {best / mixed_vllm:.2f}x vLLM" if mixed_vllm else ""
        lines.append(f"mixed-workload floor: {floor.work / 1e12:.2f} TFLOP at {floor.rate / 1e9:.0f} GFLOP/s "
                     f"({floor.how}) = {floor.seconds:.1f} s: at most {best:.0f} tok/s{vs}")
    return lines

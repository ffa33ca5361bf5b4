"""The measurements of bench_gpu.py, one function each: kvrelay's and transformers' decode and
prefill rates, the GPU's busy share of kvrelay's decode steps, and greedy tokens to compare.

Every rate is tokens over the host wall time of the steps that produced them, after warm-up, with
the device synchronized at both ends. kvrelay's decode windows hold pure decode steps only: all
prefills have run before the window opens, and no request finishes inside it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Rate:
    tokens_per_s: float
    tokens: int
    seconds: float
    step_ms: float  # median per decode step, or per prefill
    steps_per_prefill: int = 1  # engine steps one prefill took (kvrelay; 1 when it fits a step)


@dataclass(frozen=True)
class Busy:
    share: float  # union of GPU activity / host wall time of the steps
    wall_ms_per_step: float
    gpu_ms_per_step: float
    kernels_per_step: float


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Distinct random prompts without token 0 (the shapes' word tokenizer uses it as eos). Give
    each measurement its own seed: prompts of one seed share their first tokens, so a later
    measurement would hit the prefix cache."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(length)] for _ in range(count)]


# ----------------------------------------------------------------------------- kvrelay
def kvrelay_llm(loaded: Any, device: str, dtype: str, kv_cache_memory: str, seed: int, **extra: Any) -> Any:
    """The benchmark's engine: 64 sequences, 2048-token steps, 4096-token context, an explicit KV
    cache size (no profiling of the GPU's free memory), CUDA graphs unless `extra` says otherwise."""
    from kvrelay import LLM

    settings: dict[str, Any] = dict(dtype=dtype, device=device, kv_cache_memory=kv_cache_memory, seed=seed,
                                    max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=4096)
    return LLM(loaded_model=loaded, **{**settings, **extra})


def greedy(max_tokens: int) -> Any:
    from kvrelay import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@contextlib.contextmanager
def decoding(engine: Any, prompts: list[list[int]], max_tokens: int, tag: str) -> Iterator[list[str]]:
    """One request per prompt, stepped until every one has its first token: inside the block
    each step is a pure decode step (until `max_tokens`). On leaving, even by an error, the
    requests are aborted and the engine is idle again, ready for the next measurement."""
    ids = [engine.add_request({"prompt_token_ids": p}, greedy(max_tokens), request_id=f"{tag}-{i}")
           for i, p in enumerate(prompts)]
    try:
        started: set[str] = set()
        while len(started) < len(ids):
            started.update(o.request_id for o in engine.step())
        yield ids
    finally:
        engine.abort_request(ids)
        engine.run_until_idle()


def kvrelay_decode(engine: Any, device: str, batch: int, prompt_len: int, steps: int, warmup: int,
                   seed: int) -> Rate:
    """Decode tokens per second with `batch` requests decoding together."""
    prompts = random_prompts(batch, prompt_len, engine.spec.vocab_size, seed)
    step_s, tokens = [], 0
    with decoding(engine, prompts, warmup + steps + 4, f"decode{batch}"):
        for _ in range(warmup):
            engine.step()
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            tokens += sum(len(o.outputs[0].delta_token_ids) for o in engine.step())
            step_s.append(time.perf_counter() - t0)
        sync(device)
        seconds = time.perf_counter() - start
    if tokens != batch * steps:
        raise RuntimeError(f"{steps} decode steps of {batch} requests returned {tokens} tokens, "
                           f"not {batch * steps}: the window was not pure decode")
    return Rate(tokens / seconds, tokens, seconds, 1e3 * statistics.median(step_s))


def kvrelay_prefill(engine: Any, device: str, prompt_len: int, reps: int, warmup: int, seed: int) -> Rate:
    """Prompt tokens per second of one `prompt_len`-token prompt (a fresh one each time, so the
    prefix cache never helps), timed from add_request to its first token."""
    prompts = random_prompts(warmup + reps, prompt_len, engine.spec.vocab_size, seed)
    times, steps = [], []
    for i, p in enumerate(prompts):
        sync(device)
        start = time.perf_counter()
        rid = engine.add_request({"prompt_token_ids": p}, greedy(1), request_id=f"prefill-{i}")
        try:
            n = 1
            while not any(o.request_id == rid and o.finished for o in engine.step()):
                n += 1
            sync(device)
            elapsed = time.perf_counter() - start
        finally:
            engine.abort_request([rid])  # NOTE: a no-op once it finished
            engine.run_until_idle()
        if i >= warmup:
            times.append(elapsed)
            steps.append(n)
    median = statistics.median(times)
    return Rate(prompt_len / median, prompt_len * reps, sum(times), 1e3 * median, max(steps))


def kvrelay_greedy_tokens(engine: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """All prompts at once, as a user's batch would run; tokens in prompt order."""
    ids = [engine.add_request({"prompt_token_ids": p}, greedy(max_tokens), request_id=f"greedy-{i}")
           for i, p in enumerate(prompts)]
    final: dict[str, list[int]] = {}
    while len(final) < len(ids):
        final.update((o.request_id, list(o.outputs[0].token_ids)) for o in engine.step() if o.finished)
    engine.run_until_idle()
    return [final[rid] for rid in ids]


def kvrelay_busy(engine: Any, device: str, batch: int, prompt_len: int, steps: int, warmup: int,
                 seed: int) -> Busy:
    """The GPU's busy share of `steps` decode steps: the union of the kernels', copies' and
    memsets' intervals in a torch.profiler trace (CUDA activity only, so the host side is not
    slowed by recording its operators) over the host wall time of the steps."""
    from torch.profiler import ProfilerActivity, profile

    prompts = random_prompts(batch, prompt_len, engine.spec.vocab_size, seed)
    with decoding(engine, prompts, warmup + steps + 4, f"busy{batch}"):
        for _ in range(warmup):
            engine.step()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            sync(device)
            wall_s = time.perf_counter() - start
    events = trace_events(prof)
    intervals = gpu_intervals(events)
    kernels = sum(1 for e in events if e.get("cat") == "kernel")
    busy_s = union_seconds(intervals)
    return Busy(busy_s / wall_s, 1e3 * wall_s / steps, 1e3 * busy_s / steps, kernels / steps)


def trace_events(prof: Any) -> list[dict[str, Any]]:
    """The profiler's Chrome trace events (the one export whose format is stable across torch
    versions)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    return list(trace.get("traceEvents", trace) if isinstance(trace, dict) else trace)


GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_intervals(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every device activity in a Chrome trace."""
    return [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
            for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals given in microseconds, in seconds: kernels
    that overlap (two streams) count once."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total / 1e6


# ----------------------------------------------------------------------------- transformers
@functools.lru_cache(maxsize=4)
def _forward_params(model_class: Any) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


def _forward(model: Any, input_ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
    """One forward keeping the last position's logits; the cache argument and output are called
    `past_key_values` or `cache` depending on the transformers version."""
    params = _forward_params(model.__class__)
    name = "cache" if "cache" in params else "past_key_values"
    kwargs: dict[str, Any] = {"use_cache": True}
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1
    if cache is not None:
        kwargs[name] = cache
    out = model(input_ids=input_ids, **kwargs)
    new_cache = getattr(out, "cache", None) if name == "cache" else None
    return out.logits[:, -1], new_cache if new_cache is not None else out.past_key_values


@torch.inference_mode()
def hf_decode(model: Any, device: str, batch: int, prompt_len: int, steps: int, warmup: int,
              seed: int) -> Rate:
    """transformers' greedy decode, a loop over model(...) with its default dynamic cache (what
    `generate` runs), all `batch` prompts of one length so no padding is needed."""
    vocab = model.config.vocab_size
    ids = torch.tensor(random_prompts(batch, prompt_len, vocab, seed), device=device)  # [B, L]
    logits, cache = _forward(model, ids, None)
    next_ids = logits.argmax(-1, keepdim=True)  # [B, 1]
    for _ in range(warmup):
        logits, cache = _forward(model, next_ids, cache)
        next_ids = logits.argmax(-1, keepdim=True)
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        logits, cache = _forward(model, next_ids, cache)
        next_ids = logits.argmax(-1, keepdim=True)
    sync(device)
    seconds = time.perf_counter() - start
    return Rate(batch * steps / seconds, batch * steps, seconds, 1e3 * seconds / steps)


@torch.inference_mode()
def hf_prefill(model: Any, device: str, prompt_len: int, reps: int, warmup: int, seed: int) -> Rate:
    """One forward over a `prompt_len`-token prompt (cache written, last position's logits)."""
    prompts = random_prompts(warmup + reps, prompt_len, model.config.vocab_size, seed)
    times = []
    for i, p in enumerate(prompts):
        ids = torch.tensor([p], device=device)
        sync(device)
        start = time.perf_counter()
        _forward(model, ids, None)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return Rate(prompt_len / median, prompt_len * reps, sum(times), 1e3 * median)


@torch.inference_mode()
def hf_greedy_tokens(model: Any, device: str, prompt: list[int],
                     max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens for one prompt and, at each, the gap between the two largest
    logits (a mismatch where that gap is ~1e-5 is a near tie, not a bug)."""
    logits, cache = _forward(model, torch.tensor([prompt], device=device), None)
    tokens, gaps = [], []
    for _ in range(max_tokens):
        top = logits[0].float().topk(2)
        tokens.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
        if len(tokens) == max_tokens:
            break
        logits, cache = _forward(model, top.indices[:1].view(1, 1), cache)
    return tokens, gaps


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where the two token lists differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))

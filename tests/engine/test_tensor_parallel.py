"""Tensor parallelism end to end: an instance whose model is split over N worker processes gives
the log-probabilities of the same instance at TP 1 (one in-process worker) within 1e-4, through
prefill, decode, chunked prefill, prefix-cache hits and preemption; KV heads split (2 and 4 KV
heads) and replicated (1 KV head at TP 2, 2 KV heads at TP 4); Llama, Qwen2 (q/k/v bias) and
Qwen3 (q/k norm); vocabularies that split evenly over the ranks and ones that do not. The default
model, SmolLM2 (3 KV heads), at TP 3 gives TP 1's greedy tokens.

Each case starts its worker processes once (on a shared 2-core machine that is the cost)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.outputs import RequestOutput
from tests.tiny import tiny_loaded_model
from tests.tiny_mla import tiny_mla_model

# Small pool and budget: prompts are chunked (7 tokens a step) and requests get preempted.
ENGINE_ARGS: dict[str, Any] = dict(num_blocks=14, block_size=4, max_num_batched_tokens=7)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=5)

CASES = [  # (architecture, tensor_parallel_size, transformers config overrides)
    pytest.param("llama", 2, {}, id="llama-kv2-tp2-split"),
    pytest.param("qwen2", 2, {}, id="qwen2-kv2-tp2-split"),
    pytest.param("qwen3", 2, {}, id="qwen3-kv2-tp2-split"),
    # vocabularies that do not split evenly: the last rank's share of the (vocab-parallel) LM
    # head is short
    pytest.param("llama", 2, {"num_key_value_heads": 1, "vocab_size": 257}, id="llama-kv1-tp2-replicated"),
    pytest.param("llama", 4, {"num_key_value_heads": 4}, id="llama-kv4-tp4-split"),
    pytest.param("llama", 4, {"vocab_size": 258}, id="llama-kv2-tp4-replicated"),
]


def random_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def run_scenarios(llm: LLM) -> dict[str, Any]:
    """The same requests on any instance; returns the outputs and the counters that show each
    scenario really happened."""
    def generate(prompts: list[list[int]]) -> list[RequestOutput]:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)

    results: dict[str, Any] = {}
    results["single"] = generate(random_prompts(1, 20, 21, seed=1))  # chunked prefill, then decode
    base = random_prompts(1, 17, 18, seed=2)[0]
    generate([base])
    results["prefix"] = generate([base[:16] + [7, 8, 9]])  # 16 tokens (4 blocks) from the cache
    results["preempted"] = generate(random_prompts(5, 8, 20, seed=3))  # 56 slots for ~5 x 25 tokens
    stats = llm.engine.get_stats()
    results["num_preemptions"] = stats["num_preemptions"]
    results["blocks_in_use"] = llm.engine.blocks_in_use
    return results


def assert_same_logprobs(want: list[RequestOutput], got: list[RequestOutput]) -> None:
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for w_lp, g_lp in zip(w.outputs[0].logprobs or [], g.outputs[0].logprobs or [], strict=True):
            shared = w_lp.keys() & g_lp.keys()  # a near tie may swap the 5th candidate
            assert len(shared) >= 4
            for token in shared:
                assert g_lp[token].logprob == pytest.approx(w_lp[token].logprob, abs=1e-4)


@pytest.mark.parametrize("arch, tp, overrides", CASES)
def test_tensor_parallel_logprobs_equal_tp1(arch: str, tp: int, overrides: dict[str, Any]) -> None:
    reference = LLM(loaded_model=tiny_loaded_model(arch, **overrides), **ENGINE_ARGS)
    want = run_scenarios(reference)
    reference.shutdown()
    llm = LLM(loaded_model=tiny_loaded_model(arch, **overrides), tensor_parallel_size=tp, **ENGINE_ARGS)
    try:
        got = run_scenarios(llm)
    finally:
        llm.shutdown()
    assert want["num_preemptions"] > 0 and got["num_preemptions"] == want["num_preemptions"]
    assert got["prefix"][0].num_cached_tokens == want["prefix"][0].num_cached_tokens == 16
    for scenario in ("single", "prefix", "preempted"):
        assert_same_logprobs(want[scenario], got[scenario])
    assert got["blocks_in_use"] == 0
    assert all(not p.is_alive() for p in llm.engine.executor.processes)  # type: ignore[attr-defined]


def test_smollm2_tp3_greedy_equals_tp1() -> None:
    """SmolLM2-135M has 9 heads and 3 KV heads: 3 ranks with 3 heads and one KV head each."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reference = LLM(num_blocks=32, max_model_len=256)
    want = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    reference.shutdown()
    llm = LLM(num_blocks=32, max_model_len=256, tensor_parallel_size=3)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.blocks_in_use == 0
    finally:
        llm.shutdown()
    assert got == want


@pytest.mark.parametrize("tp, match", [
    (3, "tensor_parallel_size=3 does not divide the model's num_attention_heads=4"),
    (8, "tensor_parallel_size=8 does not divide the model's num_attention_heads=4"),
])
def test_impossible_split_is_refused_before_any_worker_starts(tp: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(loaded_model=tiny_loaded_model("llama"), tensor_parallel_size=tp, **ENGINE_ARGS)


def test_kv_heads_neither_split_nor_replicated_are_refused() -> None:
    loaded = tiny_loaded_model("llama", num_attention_heads=12, num_key_value_heads=4, hidden_size=96)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=6 and num_key_value_heads=4"):
        LLM(loaded_model=loaded, tensor_parallel_size=6, **ENGINE_ARGS)


def test_uni_backend_with_tp2_is_refused() -> None:
    with pytest.raises(ValueError, match="'uni' runs one worker"):
        LLM(loaded_model=tiny_loaded_model("llama"), tensor_parallel_size=2,
            distributed_executor_backend="uni", **ENGINE_ARGS)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8_e4m3"])
def test_narrow_kv_formats_at_tp2_match_tp1_in_the_same_format(kv_cache_dtype: str) -> None:
    """Each rank stores its KV heads in the format, fp8 with the scales of the heads it owns (the
    engine calibrates them once on the unsharded model): TP 2 reads back what TP 1 would."""
    prompts = random_prompts(3, 9, 20, seed=5)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)

    def run(tp: int) -> tuple[list[RequestOutput], dict[str, Any]]:
        llm = LLM(loaded_model=tiny_loaded_model("llama"), kv_cache_dtype=kv_cache_dtype,
                  tensor_parallel_size=tp, num_blocks=32, block_size=4)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            assert llm.engine.blocks_in_use == 0
            return outs, llm.engine.kv_cache_spec().fingerprint
        finally:
            llm.shutdown()

    (want, want_fp), (got, got_fp) = run(1), run(2)
    assert got_fp == want_fp  # same checkpoint, format and scales: P at TP 1 may feed D at TP 2
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for w_lp, g_lp in zip(w.outputs[0].logprobs or [], g.outputs[0].logprobs or [], strict=True):
            token = next(iter(w_lp))  # the chosen token's log-probability
            # fp8 rounding of a K/V element may flip where TP's summation order moves it by 1 ulp
            assert g_lp[token].logprob == pytest.approx(w_lp[token].logprob, abs=2e-2)


def test_mla_above_tp1_is_refused_before_any_worker_starts() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: deepseek_v3 \(MLA"):
        LLM(loaded_model=tiny_mla_model(), tensor_parallel_size=2, **ENGINE_ARGS)

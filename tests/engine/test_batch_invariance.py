"""The batch-invariant mode end to end, on the CPU, mirroring vLLM's determinism suite
(tests/v1/determinism): with `batch_invariant=True` a request's sampled-token logprobs are bitwise
(`torch.equal`) the same at every step whether it runs alone or at any place in a batch of
long prompts, whether its tokens are decoded or prefilled, however its prompt is chunked, and
whether its prefix was computed, hit in the prefix cache or loaded from an offload tier. And the
inverse: with the mode off, the batch test finds differences (so it can fail).

The tiny model (tests/tiny.py) keeps this fast; its steps still cross every route change of the
default path (more than 128 rows, mixed prefill and decode steps, prompt chunks)."""

from __future__ import annotations

import random

import pytest
import torch

from kvrelay import LLM, SamplingParams
from kvrelay.outputs import RequestOutput
from tests.engine.test_llm_engine import assert_matches_hf, assert_no_leak
from tests.kernels.builds import skip_unless_runnable
from tests.tiny import tiny_loaded_model

BLOCK_SIZE = 16
NEEDLE_TOKENS = 40
MAX_TOKENS = 24
BATCH_SIZES = (8, 21, 34, 48)
# Sampled (not greedy), each request with its own seed: the draw depends on the row alone.
SAMPLED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=1234, ignore_eos=True, logprobs=0)


def make_llm(batch_invariant: bool, arch: str = "llama", **kwargs) -> LLM:  # type: ignore[no-untyped-def]
    kwargs.setdefault("num_blocks", 1200)
    kwargs.setdefault("max_num_seqs", 64)
    return LLM(loaded_model=tiny_loaded_model(arch), block_size=BLOCK_SIZE, batch_invariant=batch_invariant,
               **kwargs)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 256) for _ in range(n)]


def sampled_logprobs(out: RequestOutput) -> torch.Tensor:
    """The logprob of the token sampled at each step, [steps] float32 as the engine computed it."""
    completion = out.outputs[0]
    return torch.tensor([step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs,
                                                                     strict=True)])


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = SAMPLED) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def needle_in_batches(llm: LLM, seed: int = 0) -> list[tuple[int, bool, bool]]:
    """The needle alone, then at a random place among 150-300-token fillers in each batch size:
    per batch size, whether every step's sampled-token logprob equals the lone run's, and
    whether its tokens do."""
    rng = random.Random(seed)
    needle = tokens(rng, NEEDLE_TOKENS)
    alone = generate(llm, [needle])[0]
    results = []
    for batch_size in BATCH_SIZES:
        prompts = [tokens(rng, rng.randrange(150, 301)) for _ in range(batch_size - 1)]
        place = rng.randrange(batch_size)
        prompts.insert(place, needle)
        batched = generate(llm, prompts)[place]
        results.append((batch_size, torch.equal(sampled_logprobs(batched), sampled_logprobs(alone)),
                        batched.outputs[0].token_ids == alone.outputs[0].token_ids))
    assert_no_leak(llm)
    return results


def same_logprobs_alone_and_among_15(llm: LLM, seed: int, place: int) -> bool:
    """Whether the needle's sampled-token logprobs alone equal those at `place` among 15 fillers."""
    rng = random.Random(seed)
    needle = tokens(rng, NEEDLE_TOKENS)
    alone = generate(llm, [needle])[0]
    prompts = [tokens(rng, rng.randrange(150, 301)) for _ in range(15)]
    prompts.insert(place, needle)
    return torch.equal(sampled_logprobs(generate(llm, prompts)[place]), sampled_logprobs(alone))


def test_a_needle_has_the_same_logprobs_alone_and_anywhere_in_batches_of_8_to_48() -> None:
    results = needle_in_batches(make_llm(True))
    assert all(same_logprobs and same_tokens for _, same_logprobs, same_tokens in results), results


def test_without_the_mode_the_needle_test_finds_differences() -> None:
    results = needle_in_batches(make_llm(False))
    assert not all(same for _, same, _ in results), f"no batch size changed a logprob: {results}"


def decoded_and_prefilled(llm: LLM, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each generated token's logprob as decoded, and from a prefill of prompt + the tokens before
    it (token ids, not text), all those prefills at once."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    decoded = generate(llm, [prompt], greedy)[0]
    generated = decoded.outputs[0].token_ids
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=0)
    prefilled = generate(llm, [prompt + generated[:i] for i in range(len(generated))], one)
    for i, out in enumerate(prefilled):
        assert out.outputs[0].token_ids == [generated[i]]
    return sampled_logprobs(decoded), torch.cat([sampled_logprobs(out) for out in prefilled])


def test_decode_logprobs_equal_the_logprobs_of_prefilling_the_prompt_and_the_tokens_before() -> None:
    llm = make_llm(True, enable_prefix_caching=False)  # each prefill computes its whole prompt
    at_decode, at_prefill = decoded_and_prefilled(llm, tokens(random.Random(1), 180))
    assert torch.equal(at_decode, at_prefill)
    assert_no_leak(llm)


def test_a_long_prompt_has_the_same_logprobs_under_three_token_budgets() -> None:
    prompt = tokens(random.Random(2), 450)
    runs = []
    for budget in (64, 200, 2048):  # 8 chunks, 3 chunks not on block edges, one step
        llm = make_llm(True, max_num_batched_tokens=budget, enable_prefix_caching=False)
        runs.append(sampled_logprobs(generate(llm, [prompt])[0]))
        assert_no_leak(llm)
    assert all(torch.equal(runs[0], run) for run in runs[1:])


def test_cold_prefix_cache_hit_and_cpu_offload_tier_give_the_same_logprobs() -> None:
    offload = {"kv_connector": "OffloadConnector",
               "kv_connector_extra_config": {"chunk_tokens": 64, "cpu_bytes": "16MiB"}}
    llm = make_llm(True, num_blocks=256, kv_transfer_config=offload)
    prompt = tokens(random.Random(3), 300)
    stats = llm.engine.get_stats
    cold = generate(llm, [prompt])[0]
    llm.engine.run_until_idle()  # the offload stores land
    assert (stats()["prompt_tokens_cached"], stats()["prompt_tokens_external"]) == (0, 0)
    hit = generate(llm, [prompt])[0]
    assert stats()["prompt_tokens_cached"] == len(prompt) // BLOCK_SIZE * BLOCK_SIZE
    assert llm.engine.scheduler.reset_prefix_cache()  # only the CPU tier can serve it now
    loaded = generate(llm, [prompt])[0]
    assert stats()["prompt_tokens_external"] >= len(prompt) // 64 * 64
    assert torch.equal(sampled_logprobs(cold), sampled_logprobs(hit))
    assert torch.equal(sampled_logprobs(cold), sampled_logprobs(loaded))
    llm.engine.run_until_idle()
    assert_no_leak(llm)
    llm.shutdown()


def test_the_thread_count_does_not_change_the_logprobs() -> None:
    llm = make_llm(True)
    rng = random.Random(4)
    prompts = [tokens(rng, n) for n in (40, 260, 170)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [sampled_logprobs(out) for out in generate(llm, prompts)]
        torch.set_num_threads(2)
        two = [sampled_logprobs(out) for out in generate(llm, prompts)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


def test_the_avx2_build_of_the_kernels_is_batch_invariant_too(monkeypatch: pytest.MonkeyPatch) -> None:
    skip_unless_runnable("haswell")
    monkeypatch.setenv("KVRELAY_NATIVE_ARCH", "haswell")  # what an AVX2-only CPU runs
    llm = make_llm(True)
    assert "kernels 8-lane fma" in llm.engine.kv.fingerprint["numerics"]
    assert same_logprobs_alone_and_among_15(llm, seed=5, place=9)


def test_tensor_parallel_2_is_batch_invariant_too() -> None:
    """Each rank's row-parallel partial products are summed by a two-rank all-reduce: a sum of two
    numbers, the same in either order, whatever the step's token count."""
    llm = make_llm(True, num_blocks=600, tensor_parallel_size=2)
    try:
        assert same_logprobs_alone_and_among_15(llm, seed=7, place=4)
        assert_no_leak(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # qwen2: biases; qwen3: norms of q and k
def test_the_mode_still_computes_the_model(arch: str) -> None:
    llm = make_llm(True, arch=arch, num_blocks=64)
    prompts = [tokens(random.Random(6), n) for n in (5, 29)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    assert_matches_hf(arch, prompts, generate(llm, prompts, greedy), 8)

"""End to end on tiny random models: kvrelay's greedy tokens and their log-probabilities match
transformers under chunked prefill, prefix-cache hits, mixed batches and preemption."""

from __future__ import annotations

import random

import pytest

from kvrelay import LLM, SamplingParams
from tests.tiny import hf_greedy, hf_model, tiny_loaded_model

GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=0)


def make_llm(arch: str = "llama", **kwargs) -> LLM:
    kwargs.setdefault("num_blocks", 64)
    kwargs.setdefault("block_size", 4)
    return LLM(loaded_model=tiny_loaded_model(arch), **kwargs)


def random_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def assert_matches_hf(arch: str, prompts: list[list[int]], outputs, max_tokens: int) -> None:
    model = hf_model(arch)
    for prompt, out in zip(prompts, outputs, strict=True):
        want_tokens, want_lps = hf_greedy(model, prompt, max_tokens)
        got = out.outputs[0]
        assert got.token_ids == want_tokens
        got_lps = [lp[tok].logprob for lp, tok in zip(got.logprobs, got.token_ids, strict=True)]
        assert got_lps == pytest.approx(want_lps, abs=2e-4)


def assert_no_leak(llm: LLM) -> None:
    assert llm.engine.blocks_in_use == 0
    assert not llm.engine.has_pending_work()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers(arch):
    llm = make_llm(arch)
    prompts = random_prompts(4, 3, 30)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=8, **GREEDY),
                        use_tqdm=False)
    assert_matches_hf(arch, prompts, outs, 8)
    assert_no_leak(llm)


def test_chunked_prefill_matches_transformers():
    llm = make_llm(max_num_batched_tokens=7)  # every prompt is cut into several chunks
    prompts = random_prompts(3, 20, 40, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=6, **GREEDY),
                        use_tqdm=False)
    assert_matches_hf("llama", prompts, outs, 6)
    assert_no_leak(llm)


def test_prefix_cache_hit_matches_and_skips_compute():
    llm = make_llm()
    base = random_prompts(1, 25, 26, seed=2)[0]
    llm.generate({"prompt_token_ids": base}, SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    computed_before = llm.engine.get_stats()["prompt_tokens_computed"]
    variant = base[:20] + [7, 8, 9]
    out = llm.generate({"prompt_token_ids": variant}, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)
    assert out[0].num_cached_tokens == 20
    assert llm.engine.get_stats()["prompt_tokens_computed"] - computed_before == 3
    assert_matches_hf("llama", [variant], out, 6)
    assert_no_leak(llm)


def test_mixed_batch_requests_join_mid_flight():
    llm = make_llm(max_num_batched_tokens=16)
    engine = llm.engine
    prompts = random_prompts(5, 5, 35, seed=3)
    params = SamplingParams(max_tokens=7, **GREEDY)
    finals = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:  # one new request per step while earlier ones decode or prefill
            i, p = pending.pop(0)
            engine.add_request({"prompt_token_ids": p}, params, request_id=str(i))
        for out in engine.step():
            if out.finished:
                finals[int(out.request_id)] = out
    assert_matches_hf("llama", prompts, [finals[i] for i in range(len(prompts))], 7)
    assert_no_leak(llm)


def test_preemption_gives_same_tokens():
    llm = make_llm(num_blocks=14)  # 56 token slots for 6 requests of up to ~40 tokens each
    prompts = random_prompts(6, 10, 25, seed=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=12, **GREEDY),
                        use_tqdm=False)
    assert llm.engine.get_stats()["num_preemptions"] > 0
    assert_matches_hf("llama", prompts, outs, 12)
    assert_no_leak(llm)


def test_seeded_sampling_is_reproducible_across_batches():
    llm = make_llm()
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": p} for p in random_prompts(3, 4, 12, seed=5)]
    batch = llm.generate([*others, prompt], [SamplingParams(max_tokens=10, temperature=1.0)] * 3 + [params],
                         use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone
    assert_no_leak(llm)


def test_stop_string_and_text():
    llm = make_llm()
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=10, **GREEDY),
                       use_tqdm=False)[0].outputs[0]
    words = out.text.split()
    assert len(words) == 10 and out.finish_reason == "length"
    stop_word = words[4]
    first = words.index(stop_word)
    stopped = llm.generate({"prompt_token_ids": [3, 4, 5]},
                           SamplingParams(max_tokens=10, stop=[stop_word], **GREEDY),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_word
    assert stopped.text == " ".join(words[:first]) + (" " if first else "")
    assert_no_leak(llm)


@pytest.mark.parametrize("prompt, match", [
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [1, 2, 999]}, "999.*vocabulary"),
    ({"prompt_token_ids": [-1]}, "-1.*vocabulary"),
    ({"prompt_token_ids": [1] * 600}, "600 tokens.*max_model_len"),
    ({"nothing": 1}, "prompt_token_ids"),
])
def test_bad_prompts_raise_and_engine_keeps_serving(prompt, match):
    llm = make_llm(max_model_len=512)
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}, prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing was queued
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert_no_leak(llm)


def test_abort_mid_generation_frees_blocks():
    llm = make_llm()
    engine = llm.engine
    rid = engine.add_request({"prompt_token_ids": list(range(1, 30))}, SamplingParams(max_tokens=50))
    for _ in range(3):
        engine.step()
    engine.abort_request(rid)
    engine.run_until_idle()
    assert_no_leak(llm)


def test_max_tokens_none_runs_to_context_end():
    llm = make_llm(max_model_len=20)
    out = llm.generate({"prompt_token_ids": list(range(1, 15))},
                       SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"
    assert_no_leak(llm)


def test_reset_prefix_cache_waits_for_running_requests_unless_told_to_preempt_them():
    llm = make_llm()
    engine = llm.engine
    prompts = random_prompts(2, 10, 20, seed=5)
    params = SamplingParams(max_tokens=12, **GREEDY)
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    for _ in range(4):  # both prompts computed, a few tokens decoded
        engine.step()
    assert engine.scheduler.num_running == 2
    assert engine.reset_prefix_cache() is False  # vLLM's answer while blocks are held
    assert engine.reset_prefix_cache(reset_running_requests=True, reset_external=True) is True
    assert engine.scheduler.num_running == 0 and engine.blocks_in_use == 0
    final = {}
    while len(final) < 2:  # the preempted requests recompute and finish as if nothing happened
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert_matches_hf("llama", prompts, [final[i] for i in ids], 12)
    hit = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert hit[0].num_cached_tokens > 0  # recomputed blocks are cached again
    assert engine.reset_prefix_cache() is True
    miss = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert miss[0].num_cached_tokens == 0
    assert_no_leak(llm)

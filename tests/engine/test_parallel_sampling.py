"""Parallel sampling (n > 1) on a tiny random model: the prompt is computed once, each choice has
its own seed stream, aborts reach every child, and nothing leaks."""

from __future__ import annotations

import pytest

from kvrelay import SamplingParams
from kvrelay.engine.parallel_sampling import child_params
from kvrelay.sampling_params import SEED_MAX, SEED_MIN
from tests.engine.test_llm_engine import assert_no_leak, make_llm, random_prompts

BLOCK = 4
SAMPLED = dict(temperature=1.0, ignore_eos=True)


def tail_tokens(prompt_len: int) -> int:
    """Prompt tokens a child computes after a full prefix hit: the hit covers the full blocks
    before the last prompt token, so what is left is the rest (1 to BLOCK tokens)."""
    return prompt_len - (prompt_len - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("prompt_len", [13, 16])  # a partial last block, and exact blocks
def test_prompt_is_computed_once_and_siblings_hit_the_prefix_cache(prompt_len):
    llm = make_llm()
    prompt = random_prompts(1, prompt_len, prompt_len + 1)[0]
    n = 4
    [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=n, max_tokens=5, seed=7, **SAMPLED),
                         use_tqdm=False)
    stats = llm.engine.get_stats()
    # Exactly: child 0 computes the whole prompt; each sibling computes only its tail and takes
    # the full blocks before the last token from the cache.
    assert stats["prompt_tokens_computed"] == prompt_len + (n - 1) * tail_tokens(prompt_len)
    assert stats["prompt_tokens_cached"] == (n - 1) * (prompt_len - tail_tokens(prompt_len))
    assert stats["generation_tokens"] == n * 5
    assert [c.index for c in out.outputs] == list(range(n))
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for c in out.outputs)
    assert out.finished and out.request_id and out.prompt_token_ids == prompt
    assert_no_leak(llm)


def test_without_prefix_caching_every_child_starts_at_once_and_computes_the_prompt():
    llm = make_llm(enable_prefix_caching=False)
    prompt = random_prompts(1, 13, 14)[0]
    [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=3, max_tokens=3, **SAMPLED),
                         use_tqdm=False)
    assert len(out.outputs) == 3
    assert llm.engine.get_stats()["prompt_tokens_computed"] == 3 * 13
    assert_no_leak(llm)


def test_seeded_children_are_reproducible_and_differ_from_each_other():
    prompt = {"prompt_token_ids": random_prompts(1, 9, 10)[0]}
    params = SamplingParams(n=3, max_tokens=12, seed=123, **SAMPLED)
    first = make_llm().generate(prompt, params, use_tqdm=False)[0]
    again = make_llm().generate(prompt, params, use_tqdm=False)[0]
    choices = [c.token_ids for c in first.outputs]
    assert choices == [c.token_ids for c in again.outputs]
    assert len({tuple(c) for c in choices}) == 3
    # Child i samples as a lone request seeded s + i would.
    alone = make_llm().generate(prompt, SamplingParams(n=1, max_tokens=12, seed=124, **SAMPLED),
                                use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == choices[1]


def test_child_seed_is_seed_plus_index_wrapping_at_64_bits():
    params = SamplingParams(n=3, seed=SEED_MAX)
    assert [child_params(params, i).seed for i in range(3)] == [SEED_MAX, SEED_MIN, SEED_MIN + 1]
    assert child_params(SamplingParams(n=2), 1).seed is None
    assert child_params(params, 1).n == 1


def test_unseeded_children_sample_independently():
    llm = make_llm()
    [out] = llm.generate({"prompt_token_ids": random_prompts(1, 9, 10)[0]},
                         SamplingParams(n=4, max_tokens=12, **SAMPLED), use_tqdm=False)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert_no_leak(llm)


def test_several_prompts_each_with_n_children_in_one_batch():
    llm = make_llm()
    prompts = random_prompts(3, 5, 20, seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(n=2, max_tokens=4, seed=1, **SAMPLED), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(len(o.outputs) == 2 for o in outs)
    assert llm.engine.get_stats()["generation_tokens"] == 3 * 2 * 4
    assert_no_leak(llm)


def test_finish_reason_is_per_choice():
    llm = make_llm()
    prompt = {"prompt_token_ids": random_prompts(1, 6, 7)[0]}
    probe = llm.generate(prompt, SamplingParams(n=2, max_tokens=6, seed=5, **SAMPLED), use_tqdm=False)[0]
    # Stop on child 1's third token: child 1 stops there, child 0 (another stream) runs to length.
    stop_token = probe.outputs[1].token_ids[2]
    assert stop_token not in probe.outputs[0].token_ids
    out = llm.generate(prompt, SamplingParams(n=2, max_tokens=6, seed=5, stop_token_ids=[stop_token],
                                              **SAMPLED), use_tqdm=False)[0]
    assert (out.outputs[0].finish_reason, out.outputs[1].finish_reason) == ("length", "stop")
    assert out.outputs[1].stop_reason == stop_token and len(out.outputs[1].token_ids) == 3
    assert_no_leak(llm)


def test_aborting_the_parent_aborts_every_child_and_frees_their_blocks():
    llm = make_llm()
    engine = llm.engine
    rid = engine.add_request({"prompt_token_ids": random_prompts(1, 10, 11)[0]},
                             SamplingParams(n=3, max_tokens=50, **SAMPLED))
    for _ in range(3):  # child 0 has its first token and its siblings are running
        engine.step()
    assert engine.scheduler.num_running == 3
    engine.abort_request(rid)
    final = [o for o in engine.step() if o.request_id == rid]
    assert final and final[-1].finished
    assert [c.finish_reason for c in final[-1].outputs] == ["abort"] * 3
    assert rid not in engine.parallel
    assert_no_leak(llm)


def test_abort_before_the_first_token_ends_the_children_not_yet_submitted():
    llm = make_llm()
    engine = llm.engine
    rid = engine.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(n=3, max_tokens=5, **SAMPLED))
    engine.abort_request(rid)
    final = engine.step()
    assert len(final) == 1 and final[0].finished
    assert [c.finish_reason for c in final[0].outputs] == ["abort"] * 3
    assert_no_leak(llm)


@pytest.mark.parametrize("kwargs, words", [
    (dict(n=0), "n must be in [1, 16384], got 0"),
    (dict(n=2, temperature=0.0), "n must be 1 when sampling greedily"),
])
def test_bad_n_is_refused(kwargs, words):
    with pytest.raises(ValueError, match=r"^n must") as info:
        SamplingParams(**kwargs)
    assert words in str(info.value)

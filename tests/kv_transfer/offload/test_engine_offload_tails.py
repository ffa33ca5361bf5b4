"""A prompt's tail (its tokens past the last full chunk) is stored under its own key, so a
repeated prompt of any length computes only its last token, from every tier, with sync and
async loads; a missing or corrupt tail falls back to recomputing from the last good chunk; a
tail serves only the exact prompt prefix it was computed for. Every test ends with no block in
use and no pending work."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay.kv_transfer.offload.meta import chunk_keys, prompt_keys
from tests.kv_transfer.offload.helpers import (
    BLOCK_SIZE,
    CHUNK_TOKENS,
    assert_no_leak,
    connector_stats,
    fresh_prefix_cache,
    generate,
    make_llm,
    offload_config,
    prompts_of,
    reference_tokens,
    run_in_fresh_process,
    stored_entries,
)

# chunk_tokens 16, block_size 4. 70: a 6-token tail (not a whole block); 67: a prompt that is not
# a whole number of blocks; 13: shorter than one chunk; 17: one token past a chunk boundary (its
# tail is never loaded, so never stored); 24: a tail of exactly two blocks; 2: the shortest
# prompt with something to load.
PROMPTS = prompts_of([70, 67, 13, 17, 24, 2], seed=21)
ASYNC = {"sync_load_max_tokens": 0}
SYNC = {"sync_load_max_tokens": 10_000}
COUNTERS = ("prompt_tokens_computed", "prompt_tokens_cached", "prompt_tokens_external", "kv_load_failures")


def counters(llm: Any) -> dict[str, int]:
    stats = llm.engine.get_stats()
    return {key: stats[key] for key in COUNTERS}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in COUNTERS}


def only_last_tokens_computed(prompts: list[list[int]]) -> dict[str, int]:
    """The counters of a repeated run served entirely by the offload store."""
    return {"prompt_tokens_computed": len(prompts), "prompt_tokens_cached": 0,
            "prompt_tokens_external": sum(len(p) - 1 for p in prompts), "kv_load_failures": 0}


def tail_file(directory: Any, llm: Any, prompt: list[int]) -> Any:
    fingerprint = llm.engine.kv_cache_spec().fingerprint_digest()
    keys = prompt_keys(prompt, CHUNK_TOKENS, fingerprint)
    assert keys.tail is not None
    return directory / f"{keys.tail}.kvc"


def test_prompt_keys_give_a_tail_only_its_exact_prefix():
    prompt = prompts_of([70], seed=1)[0]
    keys = prompt_keys(prompt, CHUNK_TOKENS, "fp")
    assert keys.chunks == chunk_keys(prompt, CHUNK_TOKENS, "fp") and len(keys.chunks) == 4
    assert keys.tail_tokens == 6 and keys.all == [*keys.chunks, keys.tail]
    changed = prompt[:-1] + [prompt[-1] + 1]
    assert prompt_keys(changed, CHUNK_TOKENS, "fp").tail != keys.tail, "every tail token is in the key"
    assert prompt_keys(prompt[:69], CHUNK_TOKENS, "fp").tail != keys.tail, "and the tail's length"
    assert prompt_keys(prompt, CHUNK_TOKENS, "other").tail != keys.tail, "and the fingerprint"
    assert keys.tail not in prompt_keys(prompt + prompts_of([10])[0], CHUNK_TOKENS, "fp").all
    assert prompt_keys(prompt[:65], CHUNK_TOKENS, "fp") == (keys.chunks, None, 0), "a 1-token tail: none"
    assert prompt_keys(prompt[:64], CHUNK_TOKENS, "fp").tail is None
    short = prompt_keys(prompt[:5], CHUNK_TOKENS, "fp")  # shorter than a chunk: a tail alone
    assert short.chunks == [] and short.tail is not None and short.tail_tokens == 5


@pytest.mark.parametrize("mode", [SYNC, ASYNC], ids=["sync", "async"])
def test_a_repeated_prompt_of_any_length_computes_only_its_last_token_from_the_cpu_tier(mode):
    llm = make_llm(offload_config(cpu_bytes="8MiB", **mode))
    first = generate(llm, PROMPTS)
    counts = connector_stats(llm)
    assert counts["offload_chunks_stored"] == sum(map(stored_entries, PROMPTS))
    assert counts["offload_tails_stored"] == 5, "every prompt but the 17-token one has a tail"
    fresh_prefix_cache(llm)
    before = counters(llm)
    assert generate(llm, PROMPTS) == first == reference_tokens(PROMPTS)
    assert delta(before, counters(llm)) == only_last_tokens_computed(PROMPTS)
    counts = connector_stats(llm)
    assert counts["offload_tails_loaded"] == 5
    assert counts.get("offload_tails_stored", 0) == 0, "a tail that was loaded is not stored again"
    assert_no_leak(llm)


def test_on_top_of_a_local_prefix_hit_the_tail_fills_the_partial_last_block():
    llm = make_llm(offload_config(cpu_bytes="8MiB"))
    generate(llm, PROMPTS)
    before = counters(llm)
    assert generate(llm, PROMPTS) == reference_tokens(PROMPTS)
    cached = sum((len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in PROMPTS)  # full blocks only
    assert delta(before, counters(llm)) == {
        "prompt_tokens_computed": len(PROMPTS), "prompt_tokens_cached": cached,
        "prompt_tokens_external": sum(len(p) - 1 for p in PROMPTS) - cached, "kv_load_failures": 0}
    assert_no_leak(llm)


@pytest.mark.parametrize("mode", [SYNC, ASYNC], ids=["sync", "async"])
def test_a_fresh_engine_loads_the_tails_from_disk(tmp_path, mode):
    config = offload_config(disk_dir=str(tmp_path), **mode)
    tokens = generate(make_llm(config), PROMPTS)
    assert len(list(tmp_path.glob("*.kvc"))) == sum(map(stored_entries, PROMPTS))
    result = run_in_fresh_process(PROMPTS, config)
    assert result["tokens"] == tokens == reference_tokens(PROMPTS)
    assert {key: result["stats"][key] for key in COUNTERS} == only_last_tokens_computed(PROMPTS)
    assert result["connector"]["offload_tails_loaded"] == 5


def test_a_fresh_engine_loads_the_tails_from_redis(redis_url):
    config = offload_config(remote_url=redis_url, **ASYNC)
    tokens = generate(make_llm(config), PROMPTS)
    result = run_in_fresh_process(PROMPTS, config)
    assert result["tokens"] == tokens == reference_tokens(PROMPTS)
    assert {key: result["stats"][key] for key in COUNTERS} == only_last_tokens_computed(PROMPTS)
    assert result["connector"]["offload_redis_hits"] == sum(map(stored_entries, PROMPTS))


@pytest.mark.parametrize("mode", [SYNC, ASYNC], ids=["sync", "async"])
def test_a_corrupt_tail_is_recomputed_from_the_last_full_chunk_and_stored_again(tmp_path, mode):
    config = offload_config(disk_dir=str(tmp_path), **mode)
    prompt = PROMPTS[0]  # 4 chunks and a 6-token tail
    generate(make_llm(config), [prompt])
    llm = make_llm(config)
    path = tail_file(tmp_path, llm, prompt)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(data)
    before = counters(llm)
    assert generate(llm, [prompt]) == reference_tokens([prompt])
    assert delta(before, counters(llm)) == {"prompt_tokens_computed": 6, "prompt_tokens_cached": 0,
                                            "prompt_tokens_external": 4 * CHUNK_TOKENS, "kv_load_failures": 1}
    counts = connector_stats(llm)
    assert counts["offload_disk_corrupt"] == 1
    assert counts["offload_tails_stored"] == 1 and counts["offload_chunks_stored"] == 1
    assert_no_leak(llm)
    third = make_llm(config)
    assert generate(third, [prompt]) == reference_tokens([prompt])
    assert counters(third) == only_last_tokens_computed([prompt])
    assert_no_leak(third)


def test_a_missing_tail_loads_the_full_chunks_and_computes_the_rest(tmp_path):
    config = offload_config(disk_dir=str(tmp_path))
    prompt = PROMPTS[1]  # 4 chunks and a 3-token tail
    first = make_llm(config)
    generate(first, [prompt])
    tail_file(tmp_path, first, prompt).unlink()  # before the next engine indexes the directory
    llm = make_llm(config)
    assert generate(llm, [prompt]) == reference_tokens([prompt])
    assert counters(llm) == {"prompt_tokens_computed": 3, "prompt_tokens_cached": 0,
                             "prompt_tokens_external": 4 * CHUNK_TOKENS, "kv_load_failures": 0}
    assert connector_stats(llm)["offload_tails_stored"] == 1
    assert tail_file(tmp_path, llm, prompt).exists()
    assert_no_leak(llm)


def test_a_tail_serves_only_the_prompt_it_was_computed_for(tmp_path):
    config = offload_config(disk_dir=str(tmp_path))
    prompt = PROMPTS[0]  # 70 tokens: 4 chunks and a 6-token tail
    generate(make_llm(config), [prompt])
    longer = prompt + prompts_of([10], seed=22)[0]  # 80 tokens: shares the tail's tokens
    other_tail = prompt[:64] + prompts_of([6], seed=23)[0]
    shorter = prompt[:69]
    for variant, num_computed in ((longer, 16), (other_tail, 6), (shorter, 5)):
        llm = make_llm(config)
        assert generate(llm, [variant]) == reference_tokens([variant])
        assert counters(llm) == {"prompt_tokens_computed": num_computed, "prompt_tokens_cached": 0,
                                 "prompt_tokens_external": 4 * CHUNK_TOKENS, "kv_load_failures": 0}
        assert connector_stats(llm).get("offload_tails_loaded", 0) == 0
        assert_no_leak(llm)

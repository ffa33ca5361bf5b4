"""OffloadConnector in the engine, on a tiny llama: a prompt computed once is loaded back from
each tier alone and from the tiers stacked (by a fresh engine in a new process for disk and
Redis), with the same greedy tokens and only the tokens after the stored prefix computed.
Every test ends with no block in use and no pending work."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from tests.kv_transfer.offload.helpers import (
    CHUNK_TOKENS,
    GREEDY,
    assert_loaded_stored_prefixes,
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
    stored_prefix,
)

# 4, 2 and 3 full chunks; tails of 6 and 5 tokens (48 = 3 chunks: 47 tokens loaded).
PROMPTS = prompts_of([70, 37, 48])
# Loads above this many tokens run in the background (WAITING_FOR_REMOTE_KVS).
ASYNC = {"sync_load_max_tokens": 0}
SYNC = {"sync_load_max_tokens": 10_000}


def compute_and_store(config: dict[str, Any]) -> list[list[int]]:
    """Engine A computes every prompt and stores its full chunks."""
    llm = make_llm(config)
    tokens = generate(llm, PROMPTS)
    stats = llm.engine.get_stats()
    assert stats["prompt_tokens_computed"] == sum(map(len, PROMPTS)) and stats["prompt_tokens_external"] == 0
    counts = connector_stats(llm)
    assert counts["offload_chunks_stored"] == sum(map(stored_entries, PROMPTS))
    assert counts.get("offload_stores_dropped", 0) == 0
    assert_no_leak(llm)
    return tokens


@pytest.mark.parametrize("mode", [SYNC, ASYNC], ids=["sync", "async"])
def test_cpu_tier_serves_a_repeated_prompt_after_the_local_prefix_cache_is_gone(mode):
    llm = make_llm(offload_config(cpu_bytes="8MiB", **mode))
    first = generate(llm, PROMPTS)
    fresh_prefix_cache(llm)
    before = llm.engine.get_stats()
    assert generate(llm, PROMPTS) == first == reference_tokens(PROMPTS)
    after = llm.engine.get_stats()
    delta = {k: after[k] - before[k] for k in ("prompt_tokens_external", "prompt_tokens_computed",
                                                "kv_load_failures")}
    assert_loaded_stored_prefixes(delta, PROMPTS)
    counts = connector_stats(llm)
    assert counts["offload_cpu_hits"] == sum(map(stored_entries, PROMPTS))
    assert counts["offload_tails_loaded"] == 2
    assert_no_leak(llm)


@pytest.mark.parametrize("mode", [SYNC, ASYNC], ids=["sync", "async"])
def test_an_offload_hit_counts_in_cached_tokens_with_the_local_hit(mode):
    """usage.prompt_tokens_details.cached_tokens (an output's num_cached_tokens) counts what a
    tier served, as vLLM counts a connector's tokens: the local hit plus the tokens loaded."""
    llm = make_llm(offload_config(cpu_bytes="8MiB", **mode))

    def cached(prompts: list[list[int]]) -> list[int]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        llm.engine.run_until_idle()
        return [out.num_cached_tokens for out in outs]

    assert cached(PROMPTS) == [0, 0, 0]
    fresh_prefix_cache(llm)
    assert cached(PROMPTS) == [stored_prefix(p) for p in PROMPTS]  # the tier alone
    fresh_prefix_cache(llm)
    first = PROMPTS[0]
    assert cached([first[:CHUNK_TOKENS + 1]]) == [CHUNK_TOKENS]  # the tier; now also cached locally
    before = llm.engine.get_stats()["prompt_tokens_cached"]
    assert cached([first]) == [stored_prefix(first)]  # one local chunk, the rest from the tier
    assert llm.engine.get_stats()["prompt_tokens_cached"] - before == CHUNK_TOKENS
    assert_no_leak(llm)


def test_disk_tier_is_loaded_by_a_fresh_engine_in_another_process(tmp_path):
    config = offload_config(disk_dir=str(tmp_path), disk_bytes="64MiB")
    tokens = compute_and_store(config)
    assert len(list(tmp_path.glob("*.kvc"))) == sum(map(stored_entries, PROMPTS))
    result = run_in_fresh_process(PROMPTS, config)
    assert result["tokens"] == tokens == reference_tokens(PROMPTS)
    assert_loaded_stored_prefixes(result["stats"], PROMPTS)
    assert result["connector"]["offload_disk_hits"] > 0


def test_redis_tier_is_loaded_by_a_fresh_engine_in_another_process(redis_url):
    config = offload_config(remote_url=redis_url, **ASYNC)
    tokens = compute_and_store(config)
    result = run_in_fresh_process(PROMPTS, config)
    assert result["tokens"] == tokens == reference_tokens(PROMPTS)
    assert_loaded_stored_prefixes(result["stats"], PROMPTS)
    assert result["connector"]["offload_redis_hits"] > 0


def test_stacked_tiers_store_everywhere_and_a_fresh_engine_loads_from_the_top_one(tmp_path, redis_url):
    config = offload_config(cpu_bytes="8MiB", disk_dir=str(tmp_path), remote_url=redis_url)
    tokens = compute_and_store(config)
    # A new process: its cpu tier is empty, the disk serves (and promotes), Redis is not asked.
    result = run_in_fresh_process(PROMPTS, config)
    assert result["tokens"] == tokens
    assert_loaded_stored_prefixes(result["stats"], PROMPTS)
    counts = result["connector"]
    assert counts["offload_disk_hits"] > 0 and counts.get("offload_redis_hits", 0) == 0
    assert counts["offload_promotions"] == counts["offload_disk_hits"]
    # Only Redis left (the disk is gone): it still serves everything.
    for path in tmp_path.glob("*.kvc"):
        path.unlink()
    result = run_in_fresh_process(PROMPTS, config)
    assert result["tokens"] == tokens
    assert_loaded_stored_prefixes(result["stats"], PROMPTS)
    assert result["connector"]["offload_redis_hits"] > 0


def test_a_prompt_sharing_a_stored_prefix_loads_it_and_computes_the_rest(tmp_path):
    config = offload_config(disk_dir=str(tmp_path))
    base = PROMPTS[0]  # 70 tokens: 4 chunks stored
    compute_and_store(config)
    # Shares the first 2 chunks and 5 more tokens, then diverges.
    partial = base[:2 * CHUNK_TOKENS + 5] + prompts_of([30], seed=9)[0]
    llm = make_llm(config)
    assert generate(llm, [partial]) == reference_tokens([partial])
    stats = llm.engine.get_stats()
    assert stats["prompt_tokens_external"] == 2 * CHUNK_TOKENS
    assert stats["prompt_tokens_computed"] == len(partial) - 2 * CHUNK_TOKENS
    assert_no_leak(llm)


def test_eviction_under_a_byte_budget_keeps_the_most_recently_used_chunks():
    a, b, c = prompts_of([33, 33, 33], seed=3)  # 2 chunks each
    llm = make_llm(offload_config(cpu_bytes=1, **SYNC))  # replaced below with a 4-chunk budget
    worker = llm.engine.runner.connector.worker
    chunk_bytes = worker.store.payload_bytes + worker.background.header_bytes  # one stored blob
    llm.engine.runner.connector.shutdown()
    llm = make_llm(offload_config(cpu_bytes=4 * chunk_bytes, **SYNC))
    generate(llm, [a])
    generate(llm, [b])
    fresh_prefix_cache(llm)
    generate(llm, [a])  # a is now more recent than b
    generate(llm, [c])  # needs 2 chunks: b's go
    fresh_prefix_cache(llm)
    before = llm.engine.get_stats()["prompt_tokens_external"]
    assert generate(llm, [a, b, c]) == reference_tokens([a, b, c])
    loaded = llm.engine.get_stats()["prompt_tokens_external"] - before
    assert loaded == stored_prefix(a) + stored_prefix(c), "a and c were kept, b was evicted"
    assert connector_stats(llm)["offload_cpu_evictions"] >= 2
    assert_no_leak(llm)


def test_a_disk_hit_is_promoted_to_the_cpu_tier(tmp_path):
    a, b = prompts_of([33, 33], seed=4)
    probe = make_llm(offload_config(cpu_bytes=1))
    probe_worker = probe.engine.runner.connector.worker
    chunk_bytes = probe_worker.store.payload_bytes + probe_worker.background.header_bytes
    probe.engine.runner.connector.shutdown()
    config = offload_config(cpu_bytes=2 * chunk_bytes, disk_dir=str(tmp_path), **SYNC)
    llm = make_llm(config)
    generate(llm, [a, b])  # b's chunks push a's out of the cpu tier; the disk keeps both
    connector_stats(llm)
    fresh_prefix_cache(llm)
    assert generate(llm, [a]) == reference_tokens([a])
    counts = connector_stats(llm)
    assert counts["offload_disk_hits"] == 2 and counts["offload_promotions"] == 2
    fresh_prefix_cache(llm)
    assert generate(llm, [a]) == reference_tokens([a])
    counts = connector_stats(llm)
    assert counts["offload_cpu_hits"] == 2 and counts.get("offload_disk_hits", 0) == 0
    assert_no_leak(llm)


def test_concurrent_requests_sharing_a_prefix_store_each_chunk_once_and_agree(tmp_path):
    prefix = prompts_of([40], seed=5)[0]  # 2 full chunks + 8 tokens
    tails = prompts_of([9, 13, 21, 5], seed=6)
    prompts = [prefix + tail for tail in tails]
    config = offload_config(disk_dir=str(tmp_path))
    llm = make_llm(config)
    assert generate(llm, prompts) == reference_tokens(prompts)
    unique = {tuple(p[:end]) for p in prompts for end in range(CHUNK_TOKENS, len(p) + 1, CHUNK_TOKENS)}
    unique |= {tuple(p) for p in prompts if len(p) % CHUNK_TOKENS >= 2}  # their tails
    assert connector_stats(llm)["offload_chunks_stored"] == len(unique)
    assert len(list(tmp_path.glob("*.kvc"))) == len(unique)
    assert_no_leak(llm)
    again = make_llm(config)
    assert generate(again, prompts) == reference_tokens(prompts)
    assert_loaded_stored_prefixes(again.engine.get_stats(), prompts)
    assert_no_leak(again)


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="per-thread priorities are a POSIX/Linux feature")
def test_the_writer_competes_for_cpu_only_while_its_backlog_is_large():
    from kvrelay.kv_transfer.offload.worker import _writer_idles

    pool = 16  # idle-only until 8 chunks wait, then competing until at most 4 do
    assert [_writer_idles(True, backlog, pool) for backlog in (0, 7, 8, 15)] == [True, True, False, False]
    assert [_writer_idles(False, backlog, pool) for backlog in (15, 5, 4, 0)] == [False, False, True, True]
    assert _writer_idles(True, 1, 1) is False and _writer_idles(False, 0, 1) is True  # a pool of one


def test_the_store_writer_thread_runs_at_the_lowest_cpu_priority():
    # A writer that competes with the model's threads delays them; it must only use what they leave.
    llm = make_llm(offload_config(cpu_bytes="64MiB"))
    generate(llm, PROMPTS[:1])  # the writer has stored at least one chunk by now
    writer = next(t for t in llm.engine.runner.connector.worker.background._threads
                  if t.name == "kvrelay-offload-store")
    assert writer.native_id is not None
    if hasattr(os, "SCHED_IDLE"):  # Linux
        assert os.sched_getscheduler(writer.native_id) == os.SCHED_IDLE
        assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER  # this thread untouched
    else:
        assert os.getpriority(os.PRIO_PROCESS, writer.native_id) == 19
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 19
    assert_no_leak(llm)
    llm.engine.shutdown()
    writer.join(10)
    assert not writer.is_alive()

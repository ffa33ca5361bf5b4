"""OffloadConnector when things go wrong: a Redis that stops mid-run, a corrupt disk file, a
corrupt Redis value, a full writer queue, and composition with another connector. The request
recomputes, the tokens stay right, and no block leaks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kv_transfer.offload.helpers import (
    CHUNK_TOKENS,
    assert_loaded_stored_prefixes,
    assert_no_leak,
    connector_stats,
    fresh_prefix_cache,
    generate,
    make_llm,
    offload_config,
    prompts_of,
    reference_tokens,
    stored_entries,
    stored_prefix,
)

PROMPTS = prompts_of([70, 37], seed=11)
ASYNC = {"sync_load_max_tokens": 0}
SYNC = {"sync_load_max_tokens": 10_000}


def test_redis_stopped_mid_run_means_recompute_no_crash_no_leak(private_redis):
    config = offload_config(remote_url=private_redis.url, remote_timeout_seconds=0.2, retry_seconds=0.5,
                            **ASYNC)
    llm = make_llm(config)
    assert generate(llm, PROMPTS) == reference_tokens(PROMPTS)
    fresh_prefix_cache(llm)
    private_redis.stop()
    # Lookups fail: nothing is loaded, everything is recomputed, stores fail and are counted.
    before = llm.engine.get_stats()
    others = prompts_of([40], seed=12)
    assert generate(llm, PROMPTS + others) == reference_tokens(PROMPTS + others)
    after = llm.engine.get_stats()
    assert after["prompt_tokens_external"] == before["prompt_tokens_external"]
    num_computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    assert num_computed == sum(map(len, PROMPTS + others))
    counts = connector_stats(llm)
    assert counts["offload_redis_errors"] >= 1
    assert_no_leak(llm)


def test_redis_dying_between_lookup_and_load_is_a_failed_load_that_recomputes(private_redis):
    config = offload_config(remote_url=private_redis.url, remote_timeout_seconds=0.2, retry_seconds=0.5,
                            **ASYNC)
    llm = make_llm(config)
    generate(llm, PROMPTS)
    fresh_prefix_cache(llm)
    scheduler = llm.engine.scheduler.connector.scheduler
    lookup = scheduler.num_new_matched_tokens

    def lookup_then_die(request, num_local):  # type: ignore[no-untyped-def]
        answer = lookup(request, num_local)
        private_redis.stop()  # the load that follows finds no server
        return answer

    scheduler.num_new_matched_tokens = lookup_then_die
    assert generate(llm, PROMPTS[:1]) == reference_tokens(PROMPTS[:1])
    stats = llm.engine.get_stats()
    assert stats["kv_load_failures"] >= 1
    assert connector_stats(llm)["offload_chunks_load_failed"] >= 1
    assert_no_leak(llm)


def corrupt_file(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(data)


@pytest.mark.parametrize("mode", [SYNC, ASYNC], ids=["sync", "async"])
def test_a_corrupt_disk_chunk_is_a_checksum_miss_then_recomputed_and_stored_again(tmp_path, mode):
    config = offload_config(disk_dir=str(tmp_path), **mode)
    prompt = PROMPTS[0]  # 4 chunks
    generate(make_llm(config), [prompt])
    # Corrupt the third chunk: the first two still load, the rest is recomputed.
    from kvrelay.kv_transfer.offload.meta import chunk_keys

    llm = make_llm(config)
    fingerprint = llm.engine.kv_cache_spec().fingerprint_digest()
    keys = chunk_keys(prompt, CHUNK_TOKENS, fingerprint)
    corrupt_file(tmp_path / f"{keys[2]}.kvc")
    assert generate(llm, [prompt]) == reference_tokens([prompt])
    stats = llm.engine.get_stats()
    assert stats["kv_load_failures"] == 1
    assert stats["prompt_tokens_external"] == 2 * CHUNK_TOKENS
    assert stats["prompt_tokens_computed"] == len(prompt) - 2 * CHUNK_TOKENS
    counts = connector_stats(llm)
    assert counts["offload_disk_corrupt"] == 1
    assert counts["offload_chunks_stored"] == 3, "recomputed chunks 2, 3 and the tail are stored again"
    assert_no_leak(llm)
    third = make_llm(config)
    assert generate(third, [prompt]) == reference_tokens([prompt])
    assert_loaded_stored_prefixes(third.engine.get_stats(), [prompt])
    assert_no_leak(third)


def test_a_corrupt_redis_value_is_a_checksum_miss(redis_server, redis_url):
    from kvrelay.kv_transfer.offload.tiers.redis import KEY_PREFIX

    config = offload_config(remote_url=redis_url, **SYNC)
    prompt = PROMPTS[0]
    generate(make_llm(config), [prompt])
    client = redis_server.client()
    names = sorted(client.keys(KEY_PREFIX + "*"))
    assert len(names) == stored_entries(prompt)
    for name in names:  # corrupt every entry: nothing valid is left to load
        value = bytearray(client.get(name))
        value[-1] ^= 0x01
        client.set(name, bytes(value))
    llm = make_llm(config)
    assert generate(llm, [prompt]) == reference_tokens([prompt])
    stats = llm.engine.get_stats()
    assert stats["prompt_tokens_external"] == 0 and stats["kv_load_failures"] == 1
    assert stats["prompt_tokens_computed"] == len(prompt)
    counts = connector_stats(llm)
    from kvrelay.kv_transfer.offload.worker import _CHUNKS_PER_READ

    # The first batched read finds its entries corrupt, and the load stops there.
    assert counts["offload_redis_corrupt"] == min(len(names), _CHUNKS_PER_READ)
    assert counts["offload_chunks_stored"] == len(names), "dropped, then stored again after recompute"
    assert_no_leak(llm)


def test_stores_beyond_the_pending_limit_are_dropped_and_counted(tmp_path):
    config = offload_config(disk_dir=str(tmp_path), max_pending_stores=1)
    prompts = prompts_of([64, 64, 64], seed=13)  # 12 chunks complete in one step
    llm = make_llm(config)
    assert generate(llm, prompts) == reference_tokens(prompts)
    counts = connector_stats(llm)
    assert counts["offload_stores_dropped"] >= 1
    assert counts["offload_chunks_stored"] + counts["offload_stores_dropped"] == 12
    assert_no_leak(llm)


def test_multi_connector_loads_from_whichever_child_holds_the_prefix(tmp_path):
    def multi(example_dir: Path, offload_dir: Path) -> dict[str, object]:
        return {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "ExampleConnector",
             "kv_connector_extra_config": {"shared_storage_path": str(example_dir)}},
            offload_config(disk_dir=str(offload_dir))]}}

    example, offload, empty_example, empty_offload = (tmp_path / n for n in ("ex", "off", "ex0", "off0"))
    prompt = PROMPTS[0]
    saver = make_llm(multi(example, offload))
    assert generate(saver, [prompt]) == reference_tokens([prompt])
    assert_no_leak(saver)
    assert len(list(offload.glob("*.kvc"))) == stored_entries(prompt)
    # Only the offload store has it.
    llm = make_llm(multi(empty_example, offload))
    assert generate(llm, [prompt]) == reference_tokens([prompt])
    stats = llm.engine.get_stats()
    assert stats["prompt_tokens_external"] == stored_prefix(prompt)
    assert connector_stats(llm)["offload_disk_hits"] == stored_entries(prompt)
    assert_no_leak(llm)
    # Only the example store has it (its prefix: every full block but the last token's).
    llm = make_llm(multi(example, empty_offload))
    assert generate(llm, [prompt]) == reference_tokens([prompt])
    assert llm.engine.get_stats()["prompt_tokens_external"] == (len(prompt) - 1) // 4 * 4
    assert_no_leak(llm)

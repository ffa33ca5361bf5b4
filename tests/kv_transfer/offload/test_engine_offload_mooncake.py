"""OffloadConnector over the Mooncake Store tier, on a tiny llama and a real mooncake_master on
loopback: two instances share prefixes through the store, and the master dying, an expired or a
corrupt object never cost more than a recompute. Every engine ends with no block in use."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvrelay.kv_transfer.offload.meta import chunk_keys
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
    run_in_fresh_process,
    stored_entries,
)

pytestmark = pytest.mark.timeout(300)
# 4 and 2 full chunks, tails of 6 and 5 tokens.
PROMPTS = prompts_of([70, 37], seed=21)
ASYNC = {"sync_load_max_tokens": 0}
SYNC = {"sync_load_max_tokens": 10_000}


def _config(master: Any, **extra: Any) -> dict[str, Any]:
    return offload_config(remote_url=master.url + "?segment=32MiB&buffer=16MiB", **extra)


@pytest.mark.parametrize("mode", [SYNC, ASYNC], ids=["sync", "async"])
def test_a_second_instance_loads_what_the_first_stored_and_computes_only_the_last_token(mooncake_master,
                                                                                       mode):
    config = _config(mooncake_master, **mode)
    a = make_llm(config)  # A stays up: its segment holds the objects
    tokens = generate(a, PROMPTS)
    assert connector_stats(a)["offload_chunks_stored"] == sum(map(stored_entries, PROMPTS))
    b = run_in_fresh_process(PROMPTS, config)
    assert b["tokens"] == tokens == reference_tokens(PROMPTS)
    assert b["stats"]["prompt_tokens_computed"] == len(PROMPTS)  # the last prompt token of each
    assert_loaded_stored_prefixes(b["stats"], PROMPTS)
    assert b["connector"]["offload_mooncake_hits"] == sum(map(stored_entries, PROMPTS))
    assert_no_leak(a)


def test_master_killed_mid_run_recomputes_keeps_serving_and_the_tier_recovers(mooncake_master):
    config = _config(mooncake_master, retry_seconds=1.0, **ASYNC)
    llm = make_llm(config)
    assert generate(llm, PROMPTS) == reference_tokens(PROMPTS)
    fresh_prefix_cache(llm)
    mooncake_master.stop()
    before = llm.engine.get_stats()
    others = prompts_of([41], seed=22)
    assert generate(llm, PROMPTS + others) == reference_tokens(PROMPTS + others)
    after = llm.engine.get_stats()
    assert after["prompt_tokens_external"] == before["prompt_tokens_external"]
    num_computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    assert num_computed == sum(map(len, PROMPTS + others))
    assert connector_stats(llm)["offload_mooncake_errors"] >= 1
    mooncake_master.start()  # a new master knows no object: the tier fills again
    deadline = time.monotonic() + 60
    while True:
        fresh_prefix_cache(llm)
        generate(llm, others)
        fresh_prefix_cache(llm)
        before = llm.engine.get_stats()
        generate(llm, others)
        if llm.engine.get_stats()["prompt_tokens_external"] > before["prompt_tokens_external"]:
            break  # stored after the restart, then loaded back
        assert time.monotonic() < deadline, "the Mooncake tier did not recover after the master came back"
        time.sleep(0.5)
    assert_no_leak(llm)


def test_corrupt_objects_are_a_checksum_miss_then_recomputed_and_stored_again(mooncake_master):
    from kvrelay.kv_transfer.offload import OffloadStats
    from kvrelay.kv_transfer.offload.tiers.mooncake_store import MooncakeStoreTier

    config = _config(mooncake_master, **SYNC)
    prompt = PROMPTS[0]
    a = make_llm(config)
    generate(a, [prompt])
    keys = chunk_keys(prompt, CHUNK_TOKENS, a.engine.kv_cache_spec().fingerprint_digest())
    raw = MooncakeStoreTier(mooncake_master.url + "?segment=0", OffloadStats())
    try:
        for key, blob in zip(keys, raw.get(keys), strict=True):
            assert blob is not None
            blob = bytearray(blob)
            blob[-1] ^= 0x01  # one flipped bit in the KV payload
            raw.put([(key, blob)])
    finally:
        raw.close()
    fresh_prefix_cache(a)
    before = a.engine.get_stats()
    assert generate(a, [prompt]) == reference_tokens([prompt])
    after = a.engine.get_stats()
    assert after["prompt_tokens_external"] == before["prompt_tokens_external"]
    assert after["kv_load_failures"] - before["kv_load_failures"] == 1
    counts = connector_stats(a)
    assert counts["offload_mooncake_corrupt"] >= 1
    assert_no_leak(a)


def test_expired_objects_are_recomputed(mooncake_master):
    config = _config(mooncake_master, remote_ttl_seconds=0.5, **SYNC)
    llm = make_llm(config)
    generate(llm, PROMPTS)
    time.sleep(1.0)
    fresh_prefix_cache(llm)
    before = llm.engine.get_stats()
    assert generate(llm, PROMPTS) == reference_tokens(PROMPTS)
    after = llm.engine.get_stats()
    assert after["prompt_tokens_external"] == before["prompt_tokens_external"]
    assert connector_stats(llm)["offload_mooncake_expired"] >= 1
    assert_no_leak(llm)

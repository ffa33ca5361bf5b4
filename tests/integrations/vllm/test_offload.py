"""KvrelayOffloadConnector in real `vllm serve` processes: a CPU tier that serves a repeated prompt,
Redis shared by two instances (keyed by vLLM's block hashes), and tier faults that degrade to
recompute, never to wrong tokens, on the session's fleet (fleet.py): P and D both run kvrelay's
P/D pull beside the tiers under vLLM's MultiConnector, by the names the `vllm.general_plugins`
entry point registers.

    P   MultiConnector[KvrelayConnector kv_producer, KvrelayOffloadConnector cpu + redis]
    D   MultiConnector[KvrelayConnector kv_consumer, KvrelayOffloadConnector disk + redis]

Neither has a prefix cache of its own, so a repeated prompt can only come from kvrelay's tiers.
The speed of a CPU-tier hit is benchmarks/bench_vllm_plugin.py's to measure; here each test
asserts that the load happened (vLLM's external hits, kvrelay's tier counters) and that the
answer is the one computed without it.
"""

from __future__ import annotations

import resource
import time

import pytest

from kvrelay.disagg.proxy import ProxyConfig, build_app
from tests.disagg.servers import ServerThread
from tests.integrations.vllm.fleet import RETRY_S, Fleet
from tests.integrations.vllm.helpers import answer, metric, prompt_set, wait_for
from tests.kv_transfer.offload.redis_server import RedisServer


def _offload(url: str, key: str) -> float:
    return metric(url, f"vllm:kvrelay_offload_{key}_total")


def _external(url: str) -> float:
    return metric(url, "vllm:external_prefix_cache_hits_total")


def _stored(url: str, num_entries: int, before: float) -> None:
    """Wait until `num_entries` more chunks or tails were stored (the writer runs in the background)."""
    wait_for(lambda: _offload(url, "chunks_stored") >= before + num_entries, 60,
             f"{num_entries} stores on {url}")


def _entries(prompt: list[int], chunk_tokens: int = 256) -> int:
    return len(prompt) // chunk_tokens + int(len(prompt) % chunk_tokens >= 2)


def _timed(url: str, prompt: list[int]) -> tuple[str, float]:
    started = time.perf_counter()
    text = answer(url, prompt)
    return text, time.perf_counter() - started


def test_a_repeated_prompt_loads_from_the_cpu_tier_and_answers_the_same(fleet: Fleet) -> None:
    prompt = prompt_set(20, lengths=(2000,))[0]
    stored = _offload(fleet.p.url, "chunks_stored")
    first, first_s = _timed(fleet.p.url, prompt)
    _stored(fleet.p.url, _entries(prompt), stored)
    hits, external = _offload(fleet.p.url, "cpu_hits"), _external(fleet.p.url)
    again, again_s = _timed(fleet.p.url, prompt)
    print(f"\n2000-token prompt on P: {first_s:.2f} s computed, {again_s:.2f} s from the cpu tier "
          "(12 tokens each)")
    assert again == first
    assert _external(fleet.p.url) - external == len(prompt) - 1  # all but the last token loaded
    assert _offload(fleet.p.url, "cpu_hits") - hits == _entries(prompt)


def test_a_second_instance_loads_the_first_ones_prefix_through_redis(fleet: Fleet) -> None:
    prompt = prompt_set(21, lengths=(1500,))[0]
    stored = _offload(fleet.p.url, "chunks_stored")
    on_p = answer(fleet.p.url, prompt)
    _stored(fleet.p.url, _entries(prompt), stored)
    hits, external = _offload(fleet.d.url, "redis_hits"), _external(fleet.d.url)
    assert answer(fleet.d.url, prompt) == on_p
    assert _external(fleet.d.url) - external == len(prompt) - 1
    assert _offload(fleet.d.url, "redis_hits") - hits == _entries(prompt)


def test_pd_and_offload_at_once_under_multiconnector(fleet: Fleet) -> None:
    prompts = prompt_set(22, lengths=(700, 1100))
    alone = [answer(fleet.p.url, prompt) for prompt in prompts]
    loaded = metric(fleet.d.url, "vllm:kvrelay_pull_bytes_loaded_total")
    app = build_app(ProxyConfig(prefill_urls=(fleet.p.url,), decode_urls=(fleet.d.url,)))
    with ServerThread(app) as proxy:
        assert [answer(proxy.url, prompt) for prompt in prompts] == alone
    assert metric(fleet.d.url, "vllm:kvrelay_pull_bytes_loaded_total") > loaded


@pytest.mark.parametrize("length", [400, 1200])  # a load inside the step, and one between steps
def test_a_corrupt_redis_entry_is_recomputed_through_vllms_invalid_blocks(fleet: Fleet, length: int) -> None:
    prompt = prompt_set(23 + length, lengths=(length,))[0]
    client = fleet.redis.client()
    stored, keys_before = _offload(fleet.p.url, "chunks_stored"), set(client.keys("*"))
    on_p = answer(fleet.p.url, prompt)
    _stored(fleet.p.url, _entries(prompt), stored)
    for key in set(client.keys("*")) - keys_before:  # this prompt's entries
        client.setrange(key, 200, b"\xff" * 64)  # inside the payload: the checksum will not match
    corrupt = _offload(fleet.d.url, "redis_corrupt")
    assert answer(fleet.d.url, prompt) == on_p
    wait_for(lambda: _offload(fleet.d.url, "redis_corrupt") > corrupt, 30, "D counting the corrupt entries")


def test_redis_down_then_restarted_empty_degrades_to_recompute(fleet: Fleet) -> None:
    stored_prompt, down_prompt = prompt_set(25, lengths=(1000, 600))
    stored = _offload(fleet.p.url, "chunks_stored")
    on_p = answer(fleet.p.url, stored_prompt)
    _stored(fleet.p.url, _entries(stored_prompt), stored)
    reference = answer(fleet.p.url, down_prompt)
    port = fleet.redis.port
    fleet.redis.stop()
    errors = _offload(fleet.d.url, "redis_errors")
    assert answer(fleet.d.url, down_prompt) == reference  # lookups fail: a miss, computed here
    assert _offload(fleet.d.url, "redis_errors") > errors
    fleet.redis = RedisServer(port)  # back, and empty: what P stored is gone
    time.sleep(RETRY_S + 0.5)  # D skips a failed Redis for retry_seconds before it asks again
    external = _external(fleet.d.url)
    assert answer(fleet.d.url, stored_prompt) == on_p
    assert _external(fleet.d.url) == external  # nothing to load: recomputed


def test_a_full_disk_degrades_to_recompute(fleet: Fleet) -> None:
    """D's worker may write at most a few MiB per file, like a disk that fills up part way through
    a chunk (as with ENOSPC, the write fails with an OSError); with Redis down as well nothing
    can be stored, so the repeat is computed again."""
    prompt = prompt_set(26, lengths=(800,))[0]
    worker = fleet.d.worker_pid()
    limits = resource.prlimit(worker, resource.RLIMIT_FSIZE)
    log_size = fleet.d.log_path.stat().st_size
    port = fleet.redis.port
    fleet.redis.stop()
    try:
        resource.prlimit(worker, resource.RLIMIT_FSIZE, (log_size + (4 << 20), limits[1]))
        errors = _offload(fleet.d.url, "disk_errors")
        first = answer(fleet.d.url, prompt)
        wait_for(lambda: _offload(fleet.d.url, "disk_errors") > errors, 60, "the disk tier failing a write")
        external = _external(fleet.d.url)
        assert answer(fleet.d.url, prompt) == first
        assert _external(fleet.d.url) == external
    finally:
        resource.prlimit(worker, resource.RLIMIT_FSIZE, limits)
        fleet.redis = RedisServer(port)
    assert not list(fleet.disk_dir.rglob(".tmp-*")), "a failed write left a partial file"


def test_no_block_stays_in_use(fleet: Fleet) -> None:
    for server in (fleet.p, fleet.d):
        wait_for(lambda s=server: metric(s.url, "vllm:kv_cache_usage_perc") == 0, 30, f"{server.url} freeing")

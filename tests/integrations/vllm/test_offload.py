"""KvrelayOffloadConnector in real `vllm serve` processes: a CPU tier that serves a repeated prompt,
Redis shared by two instances (keyed by vLLM's block hashes), and tier faults that degrade to
recompute, never to wrong tokens. Both instances run kvrelay's P/D pull beside it under vLLM's
MultiConnector, by the names the `vllm.general_plugins` entry point registers (no module path).

    A   MultiConnector[KvrelayConnector kv_producer, KvrelayOffloadConnector cpu + redis]
    B   MultiConnector[KvrelayConnector kv_consumer, KvrelayOffloadConnector disk + redis]

Both run without vLLM's own prefix cache, so a repeated prompt can only come from kvrelay's
tiers. The speed of a CPU-tier hit is benchmarks/bench_vllm_plugin.py's to measure; here each
test asserts that the load happened (vLLM's external hits, kvrelay's tier counters) and that the
answer is the one computed without it.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvrelay.disagg.proxy import ProxyConfig, build_app
from tests.disagg.servers import ServerThread
from tests.integrations.vllm.helpers import (
    answer,
    connector_config,
    metric,
    multi_config,
    prompt_set,
    vllm_args,
    wait_for,
)
from tests.kv_transfer.offload.redis_server import RedisServer
from tests.vllm_serve import VllmServer

OFFLOAD = "KvrelayOffloadConnector"
RETRY_S = 1.0  # a failed Redis is skipped this long before it is asked again


@dataclass
class Pair:
    a: VllmServer
    b: VllmServer
    redis: RedisServer
    disk_dir: Path


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    log_dir = tmp_path_factory.mktemp("vllm-offload")
    redis = RedisServer()
    disk_dir = log_dir / "disk-tier"
    pull = {"transfer_timeout_seconds": 5.0}
    tiers_a = {"cpu_bytes": "256MiB", "remote_url": redis.url, "retry_seconds": RETRY_S}
    tiers_b = {"disk_dir": str(disk_dir), "disk_bytes": "512MiB", "remote_url": redis.url,
               "retry_seconds": RETRY_S}
    a = VllmServer(log_dir / "a.log", *vllm_args(multi_config([
        connector_config("KvrelayConnector", "kv_producer", extra=pull, module_path=False),
        connector_config(OFFLOAD, "kv_both", module_path=False, extra=tiers_a)], "kv_both"),
        "--no-enable-prefix-caching"), core=0)
    b = VllmServer(log_dir / "b.log", *vllm_args(multi_config([
        connector_config("KvrelayConnector", "kv_consumer", extra=pull, module_path=False),
        connector_config(OFFLOAD, "kv_both", module_path=False, extra=tiers_b)], "kv_both"),
        "--no-enable-prefix-caching"), core=1)
    try:
        a.wait_healthy()
        b.wait_healthy()
        yield Pair(a, b, redis, disk_dir)
    finally:
        a.stop()
        b.stop()
        redis.stop()


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


def test_a_repeated_prompt_loads_from_the_cpu_tier_and_answers_the_same(pair: Pair) -> None:
    prompt = prompt_set(20, lengths=(3000,))[0]
    stored = _offload(pair.a.url, "chunks_stored")
    first, first_s = _timed(pair.a.url, prompt)
    _stored(pair.a.url, _entries(prompt), stored)
    hits, external = _offload(pair.a.url, "cpu_hits"), _external(pair.a.url)
    again, again_s = _timed(pair.a.url, prompt)
    print(f"\n3000-token prompt on A: {first_s:.2f} s computed, {again_s:.2f} s from the cpu tier "
          "(12 tokens each)")
    assert again == first
    assert _external(pair.a.url) - external == len(prompt) - 1  # all but the last token loaded
    assert _offload(pair.a.url, "cpu_hits") - hits == _entries(prompt)


def test_a_second_instance_loads_the_first_ones_prefix_through_redis(pair: Pair) -> None:
    prompt = prompt_set(21, lengths=(2000,))[0]
    stored = _offload(pair.a.url, "chunks_stored")
    on_a = answer(pair.a.url, prompt)
    _stored(pair.a.url, _entries(prompt), stored)
    hits, external = _offload(pair.b.url, "redis_hits"), _external(pair.b.url)
    assert answer(pair.b.url, prompt) == on_a
    assert _external(pair.b.url) - external == len(prompt) - 1
    assert _offload(pair.b.url, "redis_hits") - hits == _entries(prompt)


def test_pd_and_offload_at_once_under_multiconnector(pair: Pair) -> None:
    prompts = prompt_set(22, lengths=(700, 1100))
    alone = [answer(pair.a.url, prompt) for prompt in prompts]
    loaded = metric(pair.b.url, "vllm:kvrelay_pull_bytes_loaded_total")
    with ServerThread(build_app(ProxyConfig(prefill_urls=(pair.a.url,), decode_urls=(pair.b.url,)))) as proxy:
        assert [answer(proxy.url, prompt) for prompt in prompts] == alone
    assert metric(pair.b.url, "vllm:kvrelay_pull_bytes_loaded_total") > loaded


@pytest.mark.parametrize("length", [400, 2000])  # a load inside the step, and one between steps
def test_a_corrupt_redis_entry_is_recomputed_through_vllms_invalid_blocks(pair: Pair, length: int) -> None:
    prompt = prompt_set(23 + length, lengths=(length,))[0]
    stored = _offload(pair.a.url, "chunks_stored")
    on_a = answer(pair.a.url, prompt)
    _stored(pair.a.url, _entries(prompt), stored)
    client = pair.redis.client()
    keys = sorted(client.keys("*"), key=lambda k: client.object("idletime", k))  # newest first
    client.setrange(keys[0], 200, b"\xff" * 64)  # inside the payload: the checksum will not match
    corrupt = _offload(pair.b.url, "redis_corrupt")
    assert answer(pair.b.url, prompt) == on_a
    wait_for(lambda: _offload(pair.b.url, "redis_corrupt") == corrupt + 1, 30, "B counting the corrupt chunk")


def test_redis_down_then_restarted_empty_degrades_to_recompute(pair: Pair) -> None:
    stored_prompt, down_prompt = prompt_set(25, lengths=(1500, 900))
    stored = _offload(pair.a.url, "chunks_stored")
    on_a = answer(pair.a.url, stored_prompt)
    _stored(pair.a.url, _entries(stored_prompt), stored)
    reference = answer(pair.a.url, down_prompt)
    port = pair.redis.port
    pair.redis.stop()
    errors = _offload(pair.b.url, "redis_errors")
    assert answer(pair.b.url, down_prompt) == reference  # lookups fail: a miss, computed here
    assert _offload(pair.b.url, "redis_errors") > errors
    pair.redis = RedisServer(port)  # back, and empty: what A stored is gone
    time.sleep(RETRY_S + 0.5)  # B skips a failed Redis for retry_seconds before it asks again
    external = _external(pair.b.url)
    assert answer(pair.b.url, stored_prompt) == on_a
    assert _external(pair.b.url) == external  # nothing to load: recomputed


def test_a_full_disk_degrades_to_recompute(pair: Pair) -> None:
    """B's worker may write at most a few MiB per file, like a disk that fills up part way through
    a chunk (as with ENOSPC, the write fails with an OSError); with Redis down as well nothing
    can be stored, so the repeat is computed again."""
    prompt = prompt_set(26, lengths=(1200,))[0]
    worker = pair.b.worker_pid()
    limits = resource.prlimit(worker, resource.RLIMIT_FSIZE)
    log_size = pair.b.log_path.stat().st_size
    port = pair.redis.port
    pair.redis.stop()
    try:
        resource.prlimit(worker, resource.RLIMIT_FSIZE, (log_size + (4 << 20), limits[1]))
        errors = _offload(pair.b.url, "disk_errors")
        first = answer(pair.b.url, prompt)
        wait_for(lambda: _offload(pair.b.url, "disk_errors") > errors, 60, "the disk tier failing a write")
        external = _external(pair.b.url)
        assert answer(pair.b.url, prompt) == first
        assert _external(pair.b.url) == external
    finally:
        resource.prlimit(worker, resource.RLIMIT_FSIZE, limits)
        pair.redis = RedisServer(port)
    assert not list(pair.disk_dir.rglob(".tmp-*")), "a failed write left a partial file"


def test_no_block_stays_in_use(pair: Pair) -> None:
    for server in (pair.a, pair.b):
        wait_for(lambda s=server: metric(s.url, "vllm:kv_cache_usage_perc") == 0, 30, f"{server.url} freeing")

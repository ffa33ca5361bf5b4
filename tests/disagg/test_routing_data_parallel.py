"""The proxy and instances with data-parallel ranks: its KV index keys on (instance, rank), each
rank's events stream followed on its own, and an instance is worth what its best rank caches."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi import FastAPI

from kvrelay.core.block_hash import hash_token_blocks
from kvrelay.disagg.backends import Backend
from kvrelay.disagg.connections import Connections
from kvrelay.disagg.pool_manager import PoolManager
from kvrelay.disagg.proxy_config import ProxyConfig
from kvrelay.disagg.routing import KVIndex, PromptBlocks, create_policy
from kvrelay.disagg.routing.kv_index import rank_key
from kvrelay.kv_events import BlockRemoved, KVEventBatch
from kvrelay.kv_events.subscriber import StreamAddress
from tests.disagg.test_routing import BLOCK_SIZE, stored

TOKENS = list(range(1, 30))


def test_an_instance_is_scored_by_its_best_rank_never_by_the_union_of_its_ranks() -> None:
    index = KVIndex()
    a = Backend("http://a", "prefill", rank_events={1: StreamAddress("ipc:///nowhere")})
    b = Backend("http://b", "prefill")
    assert a.index_keys == ("http://a", "http://a#dp1") and b.index_keys == ("http://b",)
    for key in (*a.index_keys, *b.index_keys):
        index.track(key, subscribed=True, block_size=BLOCK_SIZE)
    index.on_batch("http://a", 0, stored(TOKENS[:8]))  # rank 0: blocks 0-1
    index.on_batch("http://a#dp1", 0, stored(TOKENS[:20]))  # rank 1: blocks 2-4 once 0-1 are evicted
    first_two = hash_token_blocks(TOKENS[:8], BLOCK_SIZE)
    index.on_batch("http://a#dp1", 1, KVEventBatch(ts=0.0, events=[BlockRemoved(first_two, medium="GPU")]))
    index.on_batch("http://b", 0, stored(TOKENS[:12]))  # blocks 0-2 on its one rank
    decision = create_policy("kv-aware", "prefill", index).choose([a, b], PromptBlocks(TOKENS))
    assert (decision.backend, decision.predicted_hit_tokens) == (b, 12)  # a's union would claim 20
    index.on_batch("http://a#dp1", 2, stored(TOKENS[:24]))  # now rank 1 holds 6 blocks
    decision = create_policy("kv-aware", "prefill", index).choose([a, b], PromptBlocks(TOKENS))
    assert (decision.backend, decision.predicted_hit_tokens) == (a, 24)


def instance_app(ranks: list[int]) -> FastAPI:
    """An instance's /health and /kv_events: rank r publishes on port 5557 + r, the first listed
    at the top (a group's rank 0, or the one rank a `--data-parallel-rank` server runs)."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    @app.get("/kv_events")
    async def kv_events() -> dict[str, Any]:
        streams = [{"dp_rank": r, "endpoint": f"tcp://*:{5557 + r}", "replay_endpoint": None} for r in ranks]
        return {"enabled": True, "endpoint": streams[0]["endpoint"], "replay_endpoint": None, "topic": "kv",
                "block_size": BLOCK_SIZE, "data_parallel_size": 4, "ranks": streams}

    return app


async def follow(url: str, ranks: list[int]) -> tuple[dict[str, str], list[str], list[str]]:
    """(index entries of the instance -> their state, the streams followed, those left after it
    was drained)."""
    manager = PoolManager(ProxyConfig(prefill_urls=(url,), decode_urls=("http://10.1.2.4:8200",),
                                      health_interval=0))
    connections = Connections(8, 2.0, httpx.Timeout(5.0), on_bytes=lambda _: None, on_stale=lambda _: None,
                              transport=httpx.ASGITransport(app=instance_app(ranks)))
    try:
        await manager.start(connections)
        try:
            assert manager.index is not None and manager.subscriber is not None
            backend = manager.prefill.backends[0]
            keys = {key: manager.index.status(key).reason for key in backend.index_keys}
            followed = sorted(source for source in manager.subscriber.stats() if source.startswith(url))
            manager.drain(url, force=True)  # idle: it leaves at once, with all its ranks
            left = sorted(source for source in manager.subscriber.stats() if source.startswith(url))
            return keys, followed, left
        finally:
            await manager.close()
    finally:
        await connections.aclose()


def test_the_pool_follows_every_ranks_event_stream_and_forgets_them_together() -> None:
    url = "http://10.1.2.3:8100"
    keys, streams, left = asyncio.run(follow(url, [0, 1, 2]))
    assert keys == {url: "ok", rank_key(url, 1): "ok", rank_key(url, 2): "ok"}
    assert streams == [url, f"{url}#dp1", f"{url}#dp2"]
    assert left == []


def test_a_server_of_one_rank_is_followed_once() -> None:
    url = "http://10.1.2.3:8102"
    keys, streams, _ = asyncio.run(follow(url, [2]))  # `kvrelay serve -dp 4 --data-parallel-rank 2`
    assert keys == {url: "ok"} and streams == [url]

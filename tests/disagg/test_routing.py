"""Routing policies, unit by unit, and kv-aware routing through the proxy over fake engines
that keep a real prefix cache and publish real KV events."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvrelay.core.block_hash import hash_token_blocks
from kvrelay.disagg.backends import Backend
from kvrelay.disagg.proxy import DisaggProxy, ProxyConfig, build_app
from kvrelay.disagg.routing import KVIndex, PromptBlocks, create_policy
from kvrelay.kv_events import BlockRemoved, BlockStored, KVEventBatch
from tests.disagg.fake_engine import BLOCK_SIZE, FakeEngine, tokenizer
from tests.disagg.servers import ServerThread
from tests.disagg.test_proxy import metric
from tests.kv_transfer.transport.helpers import wait_for

SHARED = " ".join(f"t{i}" for i in range(10, 26))  # 16 tokens: four full blocks


def prompt(tail: str) -> str:
    return f"{SHARED} {tail}"


def blocks(tokens: list[int]) -> PromptBlocks:
    return PromptBlocks(tokens)


def stored(tokens: list[int]) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=[BlockStored(
        block_hashes=hash_token_blocks(tokens, BLOCK_SIZE), parent_block_hash=None, token_ids=tokens,
        block_size=BLOCK_SIZE, lora_id=None, medium="GPU", lora_name=None)])


# ---------------------------------------------------------------------- the policies alone


def index_with(holdings: dict[str, list[int]]) -> KVIndex:
    index = KVIndex()
    for url, tokens in holdings.items():
        index.track(url, subscribed=True, block_size=BLOCK_SIZE)
        index.on_batch(url, 0, stored(tokens))
    return index


def test_kv_aware_prefill_picks_the_instance_holding_the_longest_prefix() -> None:
    tokens = list(range(1, 30))
    index = index_with({"http://a": tokens[:8], "http://b": tokens[:20], "http://c": []})
    backends = [Backend(u, "prefill") for u in ("http://a", "http://b", "http://c")]
    decision = create_policy("kv-aware", "prefill", index).choose(backends, blocks(tokens))
    assert (decision.backend.url, decision.reason) == ("http://b", "prefix_hit")
    assert decision.predicted_hit_tokens == 20 and decision.compute_tokens == len(tokens) - 20


def test_kv_aware_prefill_weighs_a_hit_against_the_work_queued_there() -> None:
    tokens = list(range(1, 30))
    index = index_with({"http://a": tokens[:20], "http://b": []})
    a, b = Backend("http://a", "prefill", queued_tokens=100), Backend("http://b", "prefill")
    decision = create_policy("kv-aware", "prefill", index).choose([a, b], blocks(tokens))
    assert (decision.backend, decision.reason) == (b, "load_over_prefix_hit")
    a.queued_tokens = 10  # now a's hit (20 tokens) outweighs its queue
    assert create_policy("kv-aware", "prefill", index).choose([a, b], blocks(tokens)).backend is a


def test_a_hit_never_includes_the_last_prompt_token() -> None:
    tokens = list(range(1, 17))  # exactly four blocks: the engine recomputes the last token
    index = index_with({"http://a": tokens})
    assert index.prefix_hit_tokens("http://a", blocks(tokens)) == 12


def test_kv_aware_decode_balances_legs_first_and_breaks_ties_by_prefix() -> None:
    tokens = list(range(1, 30))
    index = index_with({"http://a": [], "http://b": tokens[:12]})
    a, b = Backend("http://a"), Backend("http://b")
    policy = create_policy("kv-aware", "decode", index)
    assert policy.choose([a, b], blocks(tokens)).backend is b
    b.in_flight = 1
    assert policy.choose([a, b], blocks(tokens)).backend is a


def test_without_a_usable_index_or_prompt_kv_aware_routes_by_load_and_says_why() -> None:
    index = KVIndex()
    index.track("http://a", subscribed=False)
    index.track("http://b", subscribed=True)  # no block size known yet: no events so far
    a, b = Backend("http://a", "prefill", in_flight=1), Backend("http://b", "prefill")
    policy = create_policy("kv-aware", "prefill", index)
    decision = policy.choose([a, b], blocks(list(range(20))))
    assert (decision.backend, decision.reason) == (b, "index_unavailable")
    assert decision.predicted_hit_tokens is None
    assert policy.choose([a, b], PromptBlocks(None)).reason == "prompt_not_hashable"
    assert index.status("http://a").reason == "no events endpoint"
    assert index.status("http://b").reason == "no events yet"


def test_removed_blocks_and_resets_leave_the_index() -> None:
    tokens = list(range(1, 30))
    index = index_with({"http://a": tokens})
    hashes = hash_token_blocks(tokens, BLOCK_SIZE)
    index.on_batch("http://a", 1, KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=hashes[2:3],
                                                                            medium="GPU")]))
    assert index.prefix_hit_tokens("http://a", blocks(tokens)) == 8  # the chain breaks at block 2
    index.on_reset("http://a", "fell behind")
    assert index.prefix_hit_tokens("http://a", blocks(tokens)) == 0
    assert index.status("http://a").resets == 1


def test_an_offload_tier_medium_counts_as_cached() -> None:
    tokens = list(range(1, 30))
    index = index_with({"http://a": []})
    index.on_batch("http://a", 1, KVEventBatch(ts=0.0, events=[BlockStored(
        block_hashes=hash_token_blocks(tokens, BLOCK_SIZE)[:3], parent_block_hash=None, token_ids=[],
        block_size=BLOCK_SIZE, lora_id=None, medium="CPU", lora_name=None)]))
    assert index.prefix_hit_tokens("http://a", blocks(tokens)) == 12
    assert index.status("http://a").blocks == {"GPU": 0, "CPU": 3}


def test_round_robin_and_least_loaded_take_turns() -> None:
    backends = [Backend(f"http://{n}") for n in "abc"]
    rr = create_policy("round-robin", "decode", None)
    assert [rr.choose(backends, PromptBlocks(None)).backend.url for _ in range(4)] == [
        "http://a", "http://b", "http://c", "http://a"]
    backends[0].in_flight = 1
    ll = create_policy("least-loaded", "decode", None)
    assert all(ll.choose(backends, PromptBlocks(None)).backend is not backends[0] for _ in range(4))
    with pytest.raises(ValueError, match="routing policy must be one of"):
        create_policy("random", "decode", None)


# ---------------------------------------------------------------------- through the proxy


@contextmanager
def proxy_over(prefill: list[FakeEngine], decode: list[FakeEngine],
               **config: Any) -> Iterator[tuple[str, DisaggProxy, dict[str, str]]]:
    """Serve the engines and a proxy in front; yields (proxy URL, proxy, engine name -> URL)."""
    with ExitStack() as stack:
        for engine in prefill + decode:
            stack.callback(engine.close)
        urls = {e.name: stack.enter_context(ServerThread(e.app())).url for e in prefill + decode}
        app = build_app(ProxyConfig(prefill_urls=tuple(urls[e.name] for e in prefill),
                                    decode_urls=tuple(urls[e.name] for e in decode),
                                    tokenizer=tokenizer(), **config))
        server = stack.enter_context(ServerThread(app))
        yield server.url, app.state.proxy, urls


def complete(url: str, text: str, **fields: Any) -> dict[str, Any]:
    response = httpx.post(url + "/v1/completions",
                          json={"model": "tiny", "prompt": text, "max_tokens": 4, **fields}, timeout=30)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_repeated_prefixes_follow_the_instance_that_caches_them(tmp_path: Path) -> None:
    p0, p1, d = (FakeEngine(n, tmp_path) for n in ("P0", "P1", "D"))
    with proxy_over([p0, p1], [d], prefill_routing="kv-aware") as (url, proxy, urls):
        index = proxy.manager.index
        assert index is not None
        index.expected_grace_s = 0.0  # later hits must come from the events alone
        complete(url, prompt("t90 t91 t92"))
        first, other = (p0, p1) if p0.requests else (p1, p0)
        wait_for(lambda: index.status(urls[first.name]).blocks.get("GPU") == 4,
                 what="the first prompt's events")
        for tail in ("t80 t81", "t70 t71 t72 t73", "t60"):
            complete(url, prompt(tail))
        assert len(first.requests) == 4 and other.requests == []
        assert metric(url, "kvrelay_proxy_routing_decisions_total", role="prefill", reason="prefix_hit") == 3
        assert metric(url, "kvrelay_proxy_prefix_predictions_total", outcome="exact") == 4
        assert metric(url, "kvrelay_proxy_prefix_hit_tokens_total", kind="predicted") == 3 * 16
        assert metric(url, "kvrelay_proxy_prefix_hit_tokens_total", kind="actual") == 3 * 16
        assert metric(url, "kvrelay_proxy_kv_index_usable", backend=urls[first.name]) == 1
        # 4 shared blocks, then one more: only the 20-token prompt filled a fifth block.
        wait_for(lambda: metric(url, "kvrelay_proxy_kv_index_blocks", backend=urls[first.name]) == 5,
                 what="the index to count the stored blocks")


def test_an_actual_hit_ending_in_a_partial_block_is_compared_in_full_blocks(tmp_path: Path) -> None:
    """P's cached_tokens counts what an offload tier served, which may end in a partial block;
    a prediction counts full blocks, and so does the comparison."""
    p, d = FakeEngine("P", tmp_path, tail_hit_tokens=3), FakeEngine("D", tmp_path)
    with proxy_over([p], [d], prefill_routing="kv-aware") as (url, _, _):
        complete(url, prompt("t90"))
        complete(url, prompt("t91 t92"))
        assert metric(url, "kvrelay_proxy_prefix_predictions_total", outcome="exact") == 2
        assert metric(url, "kvrelay_proxy_prefix_hit_tokens_total", kind="actual") == 16


def test_a_fresh_prefix_is_expected_where_it_was_sent_and_a_silent_index_goes_stale(tmp_path: Path) -> None:
    p0, p1 = (FakeEngine(n, tmp_path, publish=False) for n in ("P0", "P1"))  # events never arrive
    d = FakeEngine("D", tmp_path)
    with proxy_over([p0, p1], [d], prefill_routing="kv-aware", kv_index_stale_after=0.3) as (url, _, urls):
        complete(url, prompt("t90"))
        complete(url, prompt("t91"))  # right after: the first leg's blocks are still expected there
        first = p0 if p0.requests else p1
        assert len(first.requests) == 2
        assert metric(url, "kvrelay_proxy_routing_decisions_total", role="prefill",
                      reason="prefix_hit") == 1
        assert metric(url, "kvrelay_proxy_prefix_predictions_total", outcome="exact") == 2
        # It computed new blocks twice, and no event says so: its index is not trusted any more.
        wait_for(lambda: metric(url, "kvrelay_proxy_kv_index_usable", backend=urls[first.name]) == 0,
                 what="the silent instance's index to go stale")
        complete(url, prompt("t92"))  # the other one holds nothing: no hit anywhere, like the first
        assert metric(url, "kvrelay_proxy_routing_decisions_total", role="prefill",
                      reason="no_prefix_hit") == 2


def test_instances_without_kv_events_are_routed_by_load_and_the_metric_says_so() -> None:
    p0, p1, d = (FakeEngine(n, events_dir=None) for n in ("P0", "P1", "D"))
    with proxy_over([p0, p1], [d], prefill_routing="kv-aware", decode_routing="kv-aware") as (url, _, _):
        for tail in ("t90", "t91", "t92", "t93"):
            complete(url, prompt(tail))
        assert len(p0.requests) == len(p1.requests) == 2  # least-loaded turns
        assert metric(url, "kvrelay_proxy_routing_decisions_total", reason="index_unavailable") == 8
        assert metric(url, "kvrelay_proxy_kv_index_usable") == 0


def test_instances_of_another_model_are_routed_by_load(tmp_path: Path) -> None:
    p, d = FakeEngine("P", tmp_path, tokenizes_differently=True), FakeEngine("D", tmp_path)
    with proxy_over([p], [d], prefill_routing="kv-aware") as (url, proxy, _):
        assert proxy.prompts.tokenizer is None  # the instances' /tokenize disagreed at start
        complete(url, prompt("t90"))
        assert metric(url, "kvrelay_proxy_routing_decisions_total", role="prefill",
                      reason="prompt_not_hashable") == 1


def test_instances_that_tokenize_alike_keep_kv_aware_routing(tmp_path: Path) -> None:
    p, d = FakeEngine("P", tmp_path), FakeEngine("D", tmp_path)
    with proxy_over([p], [d], prefill_routing="kv-aware") as (url, proxy, _):
        assert proxy.prompts.tokenizer is not None
        complete(url, prompt("t90"))
        assert metric(url, "kvrelay_proxy_routing_decisions_total", role="prefill",
                      reason="no_prefix_hit") == 1


def test_a_prompt_the_proxy_cannot_tokenize_is_routed_by_load(tmp_path: Path) -> None:
    p, d = FakeEngine("P", tmp_path), FakeEngine("D", tmp_path)
    with proxy_over([p], [d], prefill_routing="kv-aware") as (url, _, _):
        complete(url, "t5 t6", truncate_prompt_tokens=1)  # its tokens depend on D's context length
        assert metric(url, "kvrelay_proxy_routing_decisions_total", role="prefill",
                      reason="prompt_not_hashable") == 1


def subscriber_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name == "kv-events-subscriber"]


def test_a_proxy_refused_or_never_started_leaves_no_subscriber_thread() -> None:
    """The KV event subscriber's thread starts with the proxy and stops with it: a proxy whose
    config is refused, or that is built and dropped, must not leave one behind."""
    before = subscriber_threads()
    urls = {"prefill_urls": ("http://127.0.0.1:9",), "decode_urls": ("http://127.0.0.1:10",)}
    with pytest.raises(ValueError, match="one KV address"):
        DisaggProxy(ProxyConfig(**urls, prefill_routing="kv-aware", transfer_mode="push",
                                tokenizer=tokenizer()))
    proxy = DisaggProxy(ProxyConfig(**urls, prefill_routing="kv-aware", tokenizer=tokenizer()))
    assert proxy.manager.subscriber is None
    assert subscriber_threads() == before

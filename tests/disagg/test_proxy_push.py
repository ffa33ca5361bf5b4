"""The proxy's push mode against fake backends: both legs at once, D told where P's side channel
is, P's answer discarded, D's streamed back; bad mode settings refused."""

from __future__ import annotations

import time

import httpx
import pytest

from kvrelay.disagg.proxy import ProxyConfig, build_app
from kvrelay.disagg.push_mode import check_push_config, parse_kv_address
from tests.disagg.servers import FakeBackend, closed_port_url
from tests.disagg.test_proxy import CHAT_BODY, cluster, metric, sse_contents


def wait_for_requests(backend: FakeBackend, count: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(backend.requests) < count:
        assert time.monotonic() < deadline, f"{backend.name} got {len(backend.requests)} requests"
        time.sleep(0.01)


def test_push_legs_share_the_transfer_id_and_d_is_told_where_p_listens() -> None:
    p, d = FakeBackend("P"), FakeBackend("D")
    with cluster([p], [d], transfer_mode="push", prefill_kv_addresses=("127.0.0.1:14579",)) as url:
        response = httpx.post(url + "/v1/chat/completions", json=CHAT_BODY)
        wait_for_requests(p, 1)
    assert response.status_code == 200 and sse_contents(response.text)[-1] == "[DONE]"
    (prefill_leg,), (decode_leg,) = p.requests, d.requests
    request_id = decode_leg["request_id"]
    assert prefill_leg["request_id"] == request_id
    assert prefill_leg["max_tokens"] == 1 and prefill_leg["stream"] is False
    assert prefill_leg["kv_transfer_params"]["transfer_mode"] == "push"
    assert prefill_leg["kv_transfer_params"]["transfer_id"] == request_id
    assert prefill_leg["kv_transfer_params"]["do_remote_decode"] is True
    assert decode_leg["kv_transfer_params"] == {
        "do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": "push",
        "remote_request_id": request_id, "remote_engine_id": None, "remote_host": "127.0.0.1",
        "remote_port": 14579}
    assert decode_leg["stream"] is True and decode_leg["max_tokens"] == 20


def test_push_mode_does_not_wait_for_p_before_streaming_d() -> None:
    p, d = FakeBackend("P", mode="slow", delay=8.0), FakeBackend("D")
    with cluster([p], [d], transfer_mode="push", prefill_kv_addresses=("127.0.0.1:14579",)) as url:
        response = httpx.post(url + "/v1/chat/completions", json=CHAT_BODY, timeout=30)
        p_answered_before_d = p.answered
        wait_for_requests(p, 1)
    assert response.status_code == 200 and sse_contents(response.text)[-1] == "[DONE]"
    assert p_answered_before_d == 0  # D's whole answer streamed while P was still computing


def test_a_failed_push_prefill_leg_is_counted_and_d_still_answers() -> None:
    d = FakeBackend("D")
    with cluster([closed_port_url()], [d], transfer_mode="push",
                 prefill_kv_addresses=("127.0.0.1:14579",)) as url:
        response = httpx.post(url + "/v1/chat/completions", json=CHAT_BODY)
        deadline = time.monotonic() + 5
        while metric(url, "kvrelay_proxy_fallbacks_total", reason="unreachable") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert response.status_code == 200 and sse_contents(response.text)[-1] == "[DONE]"


def test_a_prompt_list_in_push_mode_gets_one_transfer_id_per_prompt() -> None:
    p, d = FakeBackend("P"), FakeBackend("D")
    body = {"model": "fake-model", "prompt": ["a", "b"], "max_tokens": 3}
    with cluster([p], [d], transfer_mode="push", prefill_kv_addresses=("127.0.0.1:14579",)) as url:
        httpx.post(url + "/v1/completions", json=body)
        wait_for_requests(p, 2)
    ids = sorted(leg["kv_transfer_params"]["transfer_id"] for leg in p.requests)
    assert ids == sorted(leg["kv_transfer_params"]["remote_request_id"] for leg in d.requests)
    assert len(set(ids)) == 2


@pytest.mark.parametrize(("mode", "addresses", "message"), [
    ("push", (), "one KV address"),
    ("push", ("127.0.0.1",), "host:port"),
    ("pull", ("127.0.0.1:1",), "only with transfer_mode 'push'"),
    ("sideways", (), "transfer_mode must be one of"),
])
def test_bad_mode_settings_are_refused_naming_the_problem(mode, addresses, message) -> None:
    with pytest.raises(ValueError, match=message):
        build_app(ProxyConfig(prefill_urls=("http://127.0.0.1:1",), decode_urls=("http://127.0.0.1:2",),
                              transfer_mode=mode, prefill_kv_addresses=addresses))


def test_kv_addresses_parse_hosts_and_ports() -> None:
    assert parse_kv_address("127.0.0.1:14579") == ("127.0.0.1", 14579)
    assert parse_kv_address("[::1]:80") == ("::1", 80)
    assert check_push_config("push", ("http://h:1/",), ("h:2",)) == {"http://h:1": ("h", 2)}
    with pytest.raises(ValueError, match="host:port"):
        parse_kv_address("h:99999")

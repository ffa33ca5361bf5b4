"""The proxy's own answers to bad requests, and its start-up log, against fake backends:
errors shaped exactly as `kvrelay serve`'s, one line about instances without KV events."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.disagg.fake_engine import tokenizer
from tests.disagg.servers import FakeBackend
from tests.disagg.test_proxy import CHAT_BODY, cluster, metric


@pytest.fixture(scope="module")
def serve() -> Iterator[TestClient]:
    """`kvrelay serve`'s app on the tiny model, to compare error answers with."""
    from kvrelay import LLM
    from kvrelay.engine.async_llm import AsyncLLM
    from kvrelay.entrypoints.openai_server import build_app
    from tests.tiny import tiny_loaded_model

    async_llm = AsyncLLM(LLM(loaded_model=tiny_loaded_model(), num_blocks=32, block_size=4).engine)
    try:
        with TestClient(build_app(async_llm, "tiny")) as http:
            yield http
    finally:
        async_llm.shutdown()


BAD_REQUESTS: list[tuple[str, str, dict[str, Any]]] = [
    ("POST", "/v1/chat/completions", {"content": b"{not json"}),  # 400, param "body"
    ("POST", "/v1/completions", {"json": [1, 2]}),  # 400: not an object
    ("GET", "/v1/nothing-here", {}),  # 404
    ("POST", "/v2/completions", {"json": {}}),  # 404
    ("GET", "/v1/completions", {}),  # 405
]


@pytest.mark.parametrize(("method", "path", "content"), BAD_REQUESTS)
def test_the_proxys_own_errors_are_exactly_serves(serve: TestClient, method: str, path: str,
                                                   content: dict[str, Any]) -> None:
    p, d = FakeBackend("P"), FakeBackend("D")
    with cluster([p], [d], prefill_routing="least-loaded", decode_routing="least-loaded") as url:
        got = httpx.request(method, url + path, headers={"Content-Type": "application/json"}, **content)
    want = serve.request(method, path, headers={"Content-Type": "application/json"}, **content)
    assert (got.status_code, got.json()) == (want.status_code, want.json())
    assert set(got.json()["error"]) == {"message", "type", "param", "code"}
    assert p.requests == [] and d.requests == []


def test_instances_without_kv_events_are_named_once_at_info_with_the_flag_to_pass(
        caplog: pytest.LogCaptureFixture) -> None:
    p, d = FakeBackend("P"), FakeBackend("D")  # neither answers GET /kv_events
    caplog.set_level(logging.INFO, logger="kvrelay.disagg")
    with cluster([p], [d], tokenizer=tokenizer(), health_interval=0.05) as url:
        for _ in range(3):
            response = httpx.post(url + "/v1/completions", json={"prompt": "t5 t6", "max_tokens": 2})
            assert response.status_code == 200
        time.sleep(0.3)  # several health checks, each asking again where they publish
    said = [r for r in caplog.records if "KV events" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO], [r.getMessage() for r in said]
    message = said[0].getMessage()
    assert message.count("http://127.0.0.1:") == 2  # both instances, in one line
    assert "--kv-events-config" in message and "enable_kv_cache_events" in message
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("kvrelay")]


# ---------------------------------------------------------------------- the client's mistakes


@pytest.mark.parametrize(("status", "param"), [(400, "temperature"), (400, "prompt"), (404, "model"),
                                               (422, "messages")])
def test_a_client_error_from_p_is_passed_on_with_no_decode_leg_and_no_fallback(status: int,
                                                                               param: str) -> None:
    p = FakeBackend("P", mode="bad_request", error_status=status, error_param=param)
    d = FakeBackend("D")
    with cluster([p], [d]) as url:
        response = httpx.post(url + "/v1/chat/completions", json=CHAT_BODY)
        counts = [metric(url, name, **labels) for name, labels in (
            ("kvrelay_proxy_client_errors_total", {"by": "prefill", "status": str(status)}),
            ("kvrelay_proxy_fallbacks_total", {}),
            ("kvrelay_proxy_legs_total", {"leg": "prefill", "outcome": "client_error"}),
            ("kvrelay_proxy_legs_total", {"leg": "decode"}))]
    assert response.status_code == status
    assert response.json()["error"] == {"message": f"{param} is wrong in P", "type": "BadRequestError",
                                        "param": param, "code": status}
    assert response.headers["x-request-id"] == p.requests[0]["request_id"]
    assert d.requests == []
    assert counts == [1, 0, 1, 0]


@pytest.mark.parametrize(("status", "param"), [(400, "kv_transfer_params"), (429, None), (408, None)])
def test_p_refusing_the_legs_own_params_or_being_busy_is_still_a_fallback(status: int,
                                                                         param: str | None) -> None:
    p = FakeBackend("P", mode="bad_request", error_status=status, error_param=str(param))
    d = FakeBackend("D")
    with cluster([p], [d]) as url:
        response = httpx.post(url + "/v1/chat/completions", json=CHAT_BODY)
        fallbacks = metric(url, "kvrelay_proxy_fallbacks_total", reason=f"http_{status}")
        client_errors = metric(url, "kvrelay_proxy_client_errors_total")
    assert response.status_code == 200 and len(d.requests) == 1
    assert (fallbacks, client_errors) == (1, 0)


def test_a_list_with_a_prompt_p_refuses_answers_with_ps_error_and_sends_no_decode_leg() -> None:
    p = FakeBackend("P", mode="bad_request", error_param="prompt")
    d = FakeBackend("D")
    with cluster([p], [d]) as url:
        response = httpx.post(url + "/v1/completions", json={"prompt": ["t5", "t6"], "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert len(p.requests) == 2 and d.requests == []


def test_max_tokens_beyond_the_decode_context_is_refused_before_p_computes() -> None:
    p, d = FakeBackend("P", max_model_len=4096), FakeBackend("D", max_model_len=40)
    words = " ".join(f"t{i}" for i in range(10, 20))
    prompt_tokens = len(tokenizer().encode(words))
    with cluster([p], [d], tokenizer=tokenizer()) as url:
        too_long = httpx.post(url + "/v1/completions", json={"prompt": words, "max_tokens": 40})
        listed = httpx.post(url + "/v1/completions", json={"prompt": ["t5", words], "max_tokens": 40})
        chat = httpx.post(url + "/v1/chat/completions", json={**CHAT_BODY, "max_completion_tokens": 50})
        refused = metric(url, "kvrelay_proxy_client_errors_total", by="proxy", status="400")
        assert p.requests == [] and d.requests == []
        fits = httpx.post(url + "/v1/completions", json={"prompt": words, "max_tokens": 40 - prompt_tokens})
    assert too_long.status_code == 400 and too_long.json()["error"] == {
        "message": f"'max_tokens' or 'max_completion_tokens' is too large: 40. This model's maximum context "
                   f"length is 40 tokens and your request has {prompt_tokens} input tokens (40 > 40 - "
                   f"{prompt_tokens}).", "type": "BadRequestError", "param": "max_tokens", "code": 400}
    assert listed.status_code == 400 and listed.json()["error"]["param"] == "max_tokens"
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_completion_tokens"
    assert refused == 3
    assert fits.status_code == 200 and len(p.requests) == len(d.requests) == 1

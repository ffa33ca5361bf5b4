"""The P/D proxy against fake prefill and decode backends on loopback."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.disagg.backends import BackendPool
from kvrelay.disagg.proxy import PREFILL_KV_TRANSFER_PARAMS, ProxyConfig, build_app
from tests.disagg.servers import FakeBackend, ServerThread, closed_port_url

CHAT_BODY: dict[str, Any] = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 20,
    "max_completion_tokens": 20,
    "temperature": 0.0,
    "stream": True,
    "stream_options": {"include_usage": True},
}


@contextmanager
def cluster(prefill: list[FakeBackend | str], decode: list[FakeBackend],
            **config: Any) -> Iterator[str]:
    """Start the fake backends and a proxy in front of them; yields the proxy's URL."""
    with ExitStack() as stack:
        def url(backend: FakeBackend | str) -> str:
            if isinstance(backend, str):
                return backend
            return stack.enter_context(ServerThread(backend.app())).url

        proxy_config = ProxyConfig(prefill_urls=tuple(map(url, prefill)),
                                   decode_urls=tuple(map(url, decode)), **config)
        yield stack.enter_context(ServerThread(build_app(proxy_config))).url


def metric(proxy_url: str, sample: str, **labels: str) -> float:
    """Sum of a sample's values in the proxy's /metrics over series matching `labels`."""
    text = httpx.get(proxy_url + "/metrics").text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == sample and labels.items() <= s.labels.items())


def sse_contents(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def test_prefill_leg_is_the_body_reduced_to_one_unstreamed_token_asking_for_remote_decode() -> None:
    p, d = FakeBackend("P"), FakeBackend("D")
    with cluster([p], [d]) as url:
        response = httpx.post(url + "/v1/chat/completions", json=CHAT_BODY)
    assert response.status_code == 200
    (prefill_leg,) = p.requests
    request_id = prefill_leg["request_id"]
    expected = {k: v for k, v in CHAT_BODY.items() if k != "stream_options"}
    expected.update(max_tokens=1, max_completion_tokens=1, stream=False, request_id=request_id,
                    kv_transfer_params=PREFILL_KV_TRANSFER_PARAMS)
    assert prefill_leg == expected
    assert p.headers[0]["x-request-id"] == request_id


def test_decode_leg_is_the_original_body_with_p_kv_transfer_params_and_the_same_request_id() -> None:
    p, d = FakeBackend("P"), FakeBackend("D")
    with cluster([p], [d]) as url:
        response = httpx.post(url + "/v1/chat/completions", json=CHAT_BODY)
    request_id = p.requests[0]["request_id"]
    (decode_leg,) = d.requests
    assert decode_leg == {**CHAT_BODY, "request_id": request_id,
                          "kv_transfer_params": p.kv_transfer_params(request_id)}
    assert d.headers[0]["x-request-id"] == request_id
    assert response.headers["x-request-id"] == request_id
    assert sse_contents(response.text)[-1] == "[DONE]"


def test_completions_route_and_non_streamed_answers_pass_through() -> None:
    p, d = FakeBackend("P"), FakeBackend("D")
    body = {"model": "fake-model", "prompt": "hello", "max_tokens": 5}
    with cluster([p], [d]) as url:
        response = httpx.post(url + "/v1/completions", json=body)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "from D"
    assert p.requests[0]["max_tokens"] == 1 and "max_completion_tokens" not in p.requests[0]
    assert d.requests[0]["max_tokens"] == 5 and "stream" not in d.requests[0]


def test_stream_is_relayed_as_it_arrives_not_buffered() -> None:
    p, d = FakeBackend("P"), FakeBackend("D", chunk_delay=0.6, num_chunks=4)
    with cluster([p], [d]) as url, httpx.stream("POST", url + "/v1/chat/completions",
                                                 json=CHAT_BODY) as response:
        start = time.monotonic()
        arrivals = [time.monotonic() - start for line in response.iter_lines() if line.startswith("data:")]
    assert len(arrivals) == 5  # 4 chunks + [DONE]
    assert arrivals[0] < 0.5, arrivals  # the first chunk did not wait for the last
    assert arrivals[-1] > 1.5, arrivals


@pytest.mark.parametrize("failure", ["down", "error", "timeout", "no_params"])
def test_prefill_failure_falls_back_to_decode_alone_and_the_client_still_gets_an_answer(failure: str) -> None:
    d = FakeBackend("D")
    p: FakeBackend | str = {"down": closed_port_url(), "error": FakeBackend("P", mode="error"),
                            "timeout": FakeBackend("P", mode="slow", delay=5.0),
                            "no_params": FakeBackend("P", mode="no_params")}[failure]
    with cluster([p], [d], prefill_timeout=0.5) as url:
        start = time.monotonic()
        response = httpx.post(url + "/v1/chat/completions",
                              json={**CHAT_BODY, "kv_transfer_params": {"bogus": 1}})
        elapsed = time.monotonic() - start
        fallbacks = metric(url, "kvrelay_proxy_fallbacks_total")
    assert response.status_code == 200
    assert sse_contents(response.text)[-1] == "[DONE]"
    (decode_leg,) = d.requests
    assert "kv_transfer_params" not in decode_leg  # D prefills locally
    assert decode_leg["stream"] is True and decode_leg["max_tokens"] == 20
    assert fallbacks == 1
    assert elapsed < 4.0  # the timeout case did not wait for the slow P


def test_fallback_reasons_are_labelled_in_metrics() -> None:
    d = FakeBackend("D")
    with cluster([closed_port_url()], [d]) as url:
        httpx.post(url + "/v1/chat/completions", json=CHAT_BODY)
        assert metric(url, 'kvrelay_proxy_fallbacks_total', reason="unreachable") == 1
        assert metric(url, 'kvrelay_proxy_legs_total', leg="prefill") == 1
        assert metric(url, 'kvrelay_proxy_legs_total', leg="decode") == 1


def test_decode_4xx_is_passed_through_with_its_status_and_body() -> None:
    p, d = FakeBackend("P"), FakeBackend("D", mode="bad_request")
    with cluster([p], [d]) as url:
        response = httpx.post(url + "/v1/chat/completions", json=CHAT_BODY)
        errors = metric(url, 'kvrelay_proxy_errors_total', kind="decode_http_400")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "temperature"
    assert errors == 1


def test_decode_unreachable_is_a_502_in_openai_error_format() -> None:
    config = ProxyConfig(prefill_urls=(closed_port_url(),), decode_urls=(closed_port_url(),))
    with ServerThread(build_app(config)) as proxy:
        response = httpx.post(proxy.url + "/v1/chat/completions", json=CHAT_BODY)
    assert response.status_code == 502
    assert "unreachable" in response.json()["error"]["message"]


def test_malformed_json_is_a_400_and_no_leg_is_sent() -> None:
    p, d = FakeBackend("P"), FakeBackend("D")
    with cluster([p], [d]) as url:
        response = httpx.post(url + "/v1/chat/completions", content=b"{not json",
                              headers={"Content-Type": "application/json"})
        array = httpx.post(url + "/v1/completions", json=[1, 2])
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    assert array.status_code == 400
    assert p.requests == [] and d.requests == []


def test_client_disconnect_cancels_the_decode_leg() -> None:
    p, d = FakeBackend("P"), FakeBackend("D", chunk_delay=0.5, num_chunks=100)
    with cluster([p], [d]) as url:
        with httpx.stream("POST", url + "/v1/chat/completions", json=CHAT_BODY) as response:
            next(response.iter_lines())
        assert d.cancelled.wait(timeout=5.0), "D kept generating for a client that left"
        deadline = time.monotonic() + 5
        while metric(url, 'kvrelay_proxy_errors_total', kind="client_disconnected") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_pool_picks_the_least_loaded_backend_round_robin_among_equals() -> None:
    pool = BackendPool("decode", ["http://a", "http://b", "http://c"])
    picked = [pool.pick().url for _ in range(3)]
    assert sorted(picked) == ["http://a", "http://b", "http://c"]
    busy = pool.acquire()
    for _ in range(4):
        assert pool.pick() is not busy
    pool.release(busy)
    assert busy.in_flight == 0
    with pytest.raises(ValueError, match="at least one"):
        BackendPool("prefill", [])
    with pytest.raises(ValueError, match="http://"):
        BackendPool("prefill", ["localhost:8000"])


def test_a_busy_decode_instance_is_skipped_for_an_idle_one() -> None:
    p = FakeBackend("P")
    d1, d2 = (FakeBackend(name, chunk_delay=0.4, num_chunks=6) for name in ("D1", "D2"))
    with cluster([p], [d1, d2]) as url:
        first_done = threading.Event()

        def long_request() -> None:
            httpx.post(url + "/v1/chat/completions", json=CHAT_BODY, timeout=30)
            first_done.set()

        worker = threading.Thread(target=long_request)
        worker.start()
        deadline = time.monotonic() + 5
        while not (d1.requests or d2.requests):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        busy, idle = (d1, d2) if d1.requests else (d2, d1)
        for _ in range(2):  # both go to the idle instance while the first stream is in flight
            httpx.post(url + "/v1/chat/completions", json={**CHAT_BODY, "stream": False})
        assert not first_done.is_set()
        worker.join()
    assert len(busy.requests) == 1 and len(idle.requests) == 2


def test_health_reports_every_backend_and_is_503_without_a_healthy_decoder() -> None:
    p, d = FakeBackend("P"), FakeBackend("D")
    down = closed_port_url()
    with cluster([p, down], [d]) as url:
        health = httpx.get(url + "/health")
        assert health.status_code == 200
        report = health.json()
        assert report["status"] == "degraded"
        assert [b["healthy"] for b in report["prefill"]] == [True, False]
        assert report["prefill"][1]["url"] == down
        assert report["decode"][0]["healthy"] is True
        assert metric(url, "kvrelay_proxy_backend_up") == 2
        d.healthy = False
        assert httpx.get(url + "/health").status_code == 503


def test_models_are_answered_by_a_decode_instance() -> None:
    with cluster([FakeBackend("P")], [FakeBackend("D")]) as url:
        models = httpx.get(url + "/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "fake-model"


def test_api_key_is_sent_to_both_legs() -> None:
    p, d = FakeBackend("P"), FakeBackend("D")
    with cluster([p], [d], api_key="sekret") as url:
        httpx.post(url + "/v1/chat/completions", json=CHAT_BODY)
    assert p.headers[0]["authorization"] == "Bearer sekret"
    assert d.headers[0]["authorization"] == "Bearer sekret"


def test_metrics_are_prometheus_text_counting_legs() -> None:
    p, d = FakeBackend("P"), FakeBackend("D")
    with cluster([p], [d]) as url:
        for _ in range(2):
            httpx.post(url + "/v1/chat/completions", json=CHAT_BODY)
        text = httpx.get(url + "/metrics").text
        assert "# TYPE kvrelay_proxy_legs_total counter" in text
        assert metric(url, 'kvrelay_proxy_requests_total', route="/v1/chat/completions") == 2
        assert metric(url, 'kvrelay_proxy_legs_total', leg="prefill") == 2
        assert metric(url, "kvrelay_proxy_fallbacks_total") == 0
        assert metric(url, "kvrelay_proxy_prefill_seconds_count") == 2


# ----------------------------------------------------------------------------------- n and prompt lists
class CompletionBackend(FakeBackend):
    """A D answering /v1/completions as kvrelay would: n choices per prompt, usage, SSE chunks."""

    async def _answer(self, body: dict[str, Any]) -> Response:
        if self.mode == "bad_request" and body["prompt"] == "bad":
            return JSONResponse({"error": {"message": "no", "type": "BadRequestError", "param": "prompt",
                                           "code": 400}}, status_code=400)
        if self.mode == "not_json" and body["prompt"] == "bad":
            return Response(b"<html>oops</html>", media_type="text/html")
        n, prompt = body.get("n", 1), body["prompt"]
        usage = {"prompt_tokens": len(str(prompt)), "completion_tokens": 2 * n,
                 "total_tokens": len(str(prompt)) + 2 * n, "prompt_tokens_details": {"cached_tokens": 1}}
        rid = f"cmpl-{body['request_id']}"
        if not body.get("stream"):
            return JSONResponse({"id": rid, "object": "text_completion", "usage": usage,
                                 "choices": [{"index": j, "text": f"{prompt}/{j}"} for j in range(n)],
                                 "kv_transfer_params": None})

        async def events() -> AsyncIterator[bytes]:
            for j in range(n):
                for piece in (f"{prompt}", f"/{j}"):
                    chunk = {"id": rid, "choices": [{"index": j, "text": piece}], "usage": None}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                    await asyncio.sleep(0.01)
            yield f"data: {json.dumps({'id': rid, 'choices': [], 'usage': usage})}\n\n".encode()
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")


def test_n_above_one_asks_p_for_one_sample_and_d_for_n() -> None:
    p, d = FakeBackend("P"), FakeBackend("D")
    with cluster([p], [d]) as url:
        httpx.post(url + "/v1/chat/completions", json={**CHAT_BODY, "n": 3, "best_of": 3})
    assert p.requests[0]["n"] == 1 and "best_of" not in p.requests[0]
    assert d.requests[0]["n"] == 3 and d.requests[0]["best_of"] == 3


def test_a_prompt_list_is_one_request_per_prompt_on_both_legs_merged_in_order() -> None:
    p, d = FakeBackend("P"), CompletionBackend("D")
    body = {"model": "fake-model", "prompt": ["aa", "bbb", "c"], "n": 2, "max_tokens": 5}
    with cluster([p], [d]) as url:
        response = httpx.post(url + "/v1/completions", json=body)
    assert response.status_code == 200
    assert sorted(leg["prompt"] for leg in p.requests) == ["aa", "bbb", "c"]
    assert all(leg["max_tokens"] == 1 and leg["n"] == 1 for leg in p.requests)
    for leg in d.requests:  # each prompt's D leg carries that prompt's own kv_transfer_params
        assert leg["kv_transfer_params"]["remote_request_id"] == leg["request_id"]
        assert leg["n"] == 2 and isinstance(leg["prompt"], str)
    assert len({leg["request_id"] for leg in d.requests}) == 3
    answer = response.json()
    assert [(c["index"], c["text"]) for c in answer["choices"]] == [
        (0, "aa/0"), (1, "aa/1"), (2, "bbb/0"), (3, "bbb/1"), (4, "c/0"), (5, "c/1")]
    assert answer["usage"] == {"prompt_tokens": 6, "completion_tokens": 12, "total_tokens": 18,
                               "prompt_tokens_details": {"cached_tokens": 3}}
    assert answer["id"] == f"cmpl-{response.headers['x-request-id']}" and answer["kv_transfer_params"] is None


def test_a_streamed_prompt_list_interleaves_renumbered_chunks_and_ends_once() -> None:
    p, d = FakeBackend("P"), CompletionBackend("D")
    body = {"model": "fake-model", "prompt": [[1, 2], [3]], "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    with cluster([p], [d]) as url:
        response = httpx.post(url + "/v1/completions", json=body)
    events = sse_contents(response.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        assert chunk["id"] == chunks[0]["id"]
    assert texts == {0: "[1, 2]/0", 1: "[1, 2]/1", 2: "[3]/0", 3: "[3]/1"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert chunks[-1]["usage"]["prompt_tokens"] == len("[1, 2]") + len("[3]")


def test_one_prompt_refused_by_d_answers_the_whole_list_with_that_error() -> None:
    p, d = FakeBackend("P"), CompletionBackend("D", mode="bad_request")
    with cluster([p], [d]) as url:
        response = httpx.post(url + "/v1/completions", json={"prompt": ["ok", "bad"], "stream": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


def test_a_list_answer_d_garbled_is_a_502_naming_the_prompt_and_every_leg_is_closed() -> None:
    p, d = FakeBackend("P"), CompletionBackend("D", mode="not_json")
    with cluster([p], [d]) as url:
        response = httpx.post(url + "/v1/completions", json={"prompt": ["bad", "ok", "fine"]})
        assert response.status_code == 502
        message = response.json()["error"]["message"]
        assert message.startswith("prompt 0 of the list: decode instance http://127.0.0.1:")
        assert "not a completion" in message and "oops" in message
        assert metric(url, "kvrelay_proxy_errors_total", kind="decode_bad_response") == 1
        assert metric(url, "kvrelay_proxy_legs_total", leg="decode", outcome="error") == 3
        assert metric(url, "kvrelay_proxy_legs_total", leg="decode", outcome="ok") == 0
        ok = httpx.post(url + "/v1/completions", json={"prompt": ["ok", "fine"]})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_a_single_prompt_list_and_token_ids_go_through_unsplit() -> None:
    p, d = FakeBackend("P"), CompletionBackend("D")
    with cluster([p], [d]) as url:
        httpx.post(url + "/v1/completions", json={"prompt": ["only"]})
        httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7]})
    assert [leg["prompt"] for leg in d.requests] == [["only"], [5, 6, 7]]

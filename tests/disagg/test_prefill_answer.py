"""No decode leg when P's single token already ends the answer."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from kvrelay.disagg.prefill_answer import can_answer_from_prefill
from tests.disagg.fake_engine import FakeEngine
from tests.disagg.test_proxy import metric
from tests.disagg.test_routing import proxy_over

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "t5 t6 t7"}], "max_tokens": 8}


def events(text: str) -> list[dict | str]:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
            for line in text.splitlines() if line.startswith("data: ")]


def test_a_first_token_that_ends_the_answer_is_answered_from_p_without_a_decode_leg(tmp_path: Path) -> None:
    p, d = FakeEngine("P", tmp_path, stop_on_first_token=True), FakeEngine("D", tmp_path)
    with proxy_over([p], [d]) as (url, _, _):
        response = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert response.status_code == 200
        answer = response.json()
        assert answer["choices"][0]["finish_reason"] == "stop" and answer["usage"]["completion_tokens"] == 1
        assert answer["id"] == f"cmpl-{p.requests[0]['request_id']}"
        assert d.requests == []
        assert metric(url, "kvrelay_proxy_legs_total", leg="prefill", outcome="final") == 1
        assert metric(url, "kvrelay_proxy_fallbacks_total") == 0


def test_a_streamed_request_gets_ps_answer_as_the_server_would_stream_it(tmp_path: Path) -> None:
    p, d = FakeEngine("P", tmp_path, stop_on_first_token=True), FakeEngine("D", tmp_path)
    with proxy_over([p], [d]) as (url, _, _):
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert response.headers["content-type"].startswith("text/event-stream")
        role, final, usage, done = events(response.text)
        assert role["object"] == "chat.completion.chunk" and role["usage"] is None  # type: ignore[index]
        assert role["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},  # type: ignore[index]
                                    "logprobs": None, "finish_reason": None}]
        assert final["choices"][0]["finish_reason"] == "stop" and final["choices"][0]["delta"] == {}  # type: ignore[index]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 1  # type: ignore[index]
        assert done == "[DONE]" and d.requests == []
        completion = httpx.post(url + "/v1/completions", timeout=30,
                                json={"prompt": "t5 t6", "max_tokens": 4, "stream": True})
        (chunk, done) = events(completion.text)
        assert chunk["object"] == "text_completion" and chunk["choices"][0]["text"] == ""  # type: ignore[index]
        assert "usage" not in chunk and d.requests == []  # type: ignore[operator]


@pytest.mark.parametrize("fields", [{"n": 2}, {"min_tokens": 3}, {"echo": True},
                                    {"stream": True, "stream_options": {"continuous_usage_stats": True}}])
def test_requests_whose_answer_could_differ_still_go_to_d(tmp_path: Path, fields: dict) -> None:
    p, d = FakeEngine("P", tmp_path, stop_on_first_token=True), FakeEngine("D", tmp_path)
    with proxy_over([p], [d]) as (url, _, _):
        response = httpx.post(url + "/v1/chat/completions", json={**CHAT, **fields}, timeout=30)
        assert response.status_code == 200
        assert len(d.requests) == 1


def test_only_a_stop_of_the_one_choice_is_final() -> None:
    stop = {"choices": [{"index": 0, "finish_reason": "stop"}]}
    assert can_answer_from_prefill({}, stop)
    assert not can_answer_from_prefill({}, {"choices": [{"index": 0, "finish_reason": "length"}]})
    assert not can_answer_from_prefill({}, {"choices": []})
    assert not can_answer_from_prefill({"best_of": 2}, stop)

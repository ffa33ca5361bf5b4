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


LIST = {"model": "tiny", "prompt": ["t1 t2", "t3 t4", "t5 t6"], "max_tokens": 4}


def test_a_prompt_list_sends_d_only_the_prompts_p_did_not_finish(tmp_path: Path) -> None:
    p, d = FakeEngine("P", tmp_path, stop_prompts=("t3 t4",)), FakeEngine("D", tmp_path)
    with proxy_over([p], [d]) as (url, _, _):
        response = httpx.post(url + "/v1/completions", json=LIST, timeout=30)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert sorted(leg["prompt"] for leg in p.requests) == ["t1 t2", "t3 t4", "t5 t6"]
        assert sorted(leg["prompt"] for leg in d.requests) == ["t1 t2", "t5 t6"]
        assert [(c["index"], c["text"], c["finish_reason"]) for c in answer["choices"]] == [
            (0, "from D", "length"), (1, "", "stop"), (2, "from D", "length")]
        assert answer["id"] == f"cmpl-{response.headers['x-request-id']}"
        # usage sums the two D answers and P's answer to the finished prompt (2 tokens each)
        assert answer["usage"]["prompt_tokens"] == 6 and answer["usage"]["completion_tokens"] == 3
        assert metric(url, "kvrelay_proxy_legs_total", leg="prefill", outcome="final") == 1
        assert metric(url, "kvrelay_proxy_legs_total", leg="decode", outcome="ok") == 2
        assert metric(url, "kvrelay_proxy_fallbacks_total") == 0


def test_a_streamed_prompt_list_relays_ps_final_answer_beside_ds_streams(tmp_path: Path) -> None:
    p, d = FakeEngine("P", tmp_path, stop_prompts=("t1 t2",)), FakeEngine("D", tmp_path)
    with proxy_over([p], [d]) as (url, _, _):
        body = {**LIST, "stream": True, "stream_options": {"include_usage": True}}
        response = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        *chunks, done = events(response.text)
        assert done == "[DONE]" and "[DONE]" not in chunks
        texts: dict[int, list[str]] = {}
        for chunk in chunks[:-1]:
            (choice,) = chunk["choices"]  # type: ignore[index]
            text = choice["text"] if "text" in choice else choice["delta"]["content"]  # fake D: deltas
            texts.setdefault(choice["index"], []).append(text)
        assert texts[0] == [""] and texts[1] == texts[2] == ["tok0 ", "tok1 ", "tok2 "]
        finished = [c for c in chunks[:-1] if c["choices"][0]["index"] == 0]  # type: ignore[index]
        assert finished[0]["choices"][0]["finish_reason"] == "stop"  # type: ignore[index]
        assert finished[0]["id"] == f"cmpl-{response.headers['x-request-id']}"  # type: ignore[index]
        # the fake D streams no usage chunk: the one at the end is P's, for the finished prompt
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 1  # type: ignore[index]
        assert sorted(leg["prompt"] for leg in d.requests) == ["t3 t4", "t5 t6"]
        assert metric(url, "kvrelay_proxy_legs_total", leg="decode", outcome="ok") == 2


def test_a_prompt_list_that_p_finishes_entirely_sends_nothing_to_d(tmp_path: Path) -> None:
    p, d = FakeEngine("P", tmp_path, stop_on_first_token=True), FakeEngine("D", tmp_path)
    with proxy_over([p], [d]) as (url, _, _):
        plain = httpx.post(url + "/v1/completions", json=LIST, timeout=30)
        streamed = httpx.post(url + "/v1/completions", json={**LIST, "stream": True}, timeout=30)
        assert plain.status_code == streamed.status_code == 200, (plain.text, streamed.text)
        assert [c["finish_reason"] for c in plain.json()["choices"]] == ["stop"] * 3
        *chunks, done = events(streamed.text)
        assert done == "[DONE]"
        assert sorted((c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks) == [  # type: ignore[index]
            (0, "stop"), (1, "stop"), (2, "stop")]
        assert d.requests == []


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

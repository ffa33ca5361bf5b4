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
from tests.disagg.test_proxy import cluster


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

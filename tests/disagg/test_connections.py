"""The proxy's connections: a request on a stale keep-alive connection is sent once more on a
fresh one, never a request the server may have read; bytes from an instance are reported."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import ExitStack

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from kvrelay.disagg.connections import Connections, origin
from tests.disagg.servers import FakeBackend, ServerThread, closed_port_url, closes_idle_connections

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


class Recorder:
    def __init__(self) -> None:
        self.stale: list[str] = []
        self.bytes_from: list[str] = []


def connections(recorder: Recorder, keepalive_expiry: float = 5.0) -> Connections:
    return Connections(8, keepalive_expiry, httpx.Timeout(10.0), on_bytes=recorder.bytes_from.append,
                       on_stale=recorder.stale.append)


async def post(conns: Connections, url: str, stream: bool = False) -> httpx.Response:
    body = {**BODY, "stream": stream}
    request = conns.pooled.build_request("POST", url + "/v1/chat/completions", json=body)
    return await conns.send(request, stream=stream)


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "reset"])
def test_a_request_on_a_stale_reused_connection_is_sent_once_more_on_a_fresh_one(reset: bool) -> None:
    backend, recorder = FakeBackend("D"), Recorder()

    async def run(url: str) -> list[int]:
        conns = connections(recorder)
        try:
            statuses = []
            for stream in (False, True):
                statuses.append((await post(conns, url)).status_code)  # a new connection, then pooled
                await asyncio.sleep(0.15)  # idle past the server's 0.1 s: it drops the next request
                response = await post(conns, url, stream=stream)  # the retry's connection is not pooled
                text = (await response.aread()).decode()
                await response.aclose()
                assert "from D" in text or text.rstrip().endswith("data: [DONE]")
                statuses.append(response.status_code)
            return statuses
        finally:
            await conns.aclose()

    with ServerThread(backend.app(), http=closes_idle_connections(0.1, reset=reset)) as server:
        assert asyncio.run(run(server.url)) == [200] * 4
    assert len(backend.requests) == 4  # each read once: the dropped copies never reached the app
    assert recorder.stale == [server.url, server.url]


def test_a_request_whose_answer_had_begun_is_never_sent_again() -> None:
    """The server read the request and began answering, then the connection broke: sending it
    again could run it twice, so the error stands."""
    received: list[int] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def half_answer() -> StreamingResponse:
        received.append(1)

        async def chunks() -> AsyncIterator[bytes]:
            yield b"data: {}\n\n"
            if len(received) > 1:
                raise RuntimeError("the server broke mid-answer")

        return StreamingResponse(chunks(), media_type="text/event-stream")

    recorder = Recorder()

    async def run(url: str) -> None:
        conns = connections(recorder)
        try:
            assert (await post(conns, url)).status_code == 200  # leaves a pooled connection
            with pytest.raises(httpx.TransportError):
                await post(conns, url)  # reused, and broken after the headers
        finally:
            await conns.aclose()

    with ServerThread(app) as server:
        asyncio.run(run(server.url))
    assert len(received) == 2 and recorder.stale == []


def test_a_failure_to_connect_is_not_retried() -> None:
    recorder = Recorder()

    async def run() -> None:
        conns = connections(recorder)
        try:
            with pytest.raises(httpx.ConnectError):
                await post(conns, closed_port_url())
        finally:
            await conns.aclose()

    asyncio.run(run())
    assert recorder.stale == []


def test_every_answer_and_chunk_is_reported_as_bytes_from_its_instance_but_health_checks_are_not() -> None:
    p, d = FakeBackend("P"), FakeBackend("D", num_chunks=4)
    recorder = Recorder()

    async def run(p_url: str, d_url: str) -> None:
        conns = connections(recorder)
        try:
            await post(conns, p_url)
            assert recorder.bytes_from and set(recorder.bytes_from) == {p_url}
            recorder.bytes_from.clear()
            response = await post(conns, d_url, stream=True)
            async for _ in response.aiter_raw():
                pass
            await response.aclose()
            assert len(recorder.bytes_from) >= 1 + 5  # the headers, then every chunk
            assert set(recorder.bytes_from) == {d_url}
            recorder.bytes_from.clear()
            assert (await conns.checks.get(d_url + "/health")).status_code == 200
            assert recorder.bytes_from == []
        finally:
            await conns.aclose()

    with ExitStack() as stack:
        urls = [stack.enter_context(ServerThread(b.app())).url for b in (p, d)]
        asyncio.run(run(*urls))


def test_an_origin_is_scheme_host_and_port() -> None:
    assert origin("http://127.0.0.1:8100/v1/completions?x=1") == "http://127.0.0.1:8100"
    assert origin(httpx.URL("http://Example.com/health")) == "http://example.com"

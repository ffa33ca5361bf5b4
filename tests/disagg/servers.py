"""Test servers: run an ASGI app on a loopback port in a thread, and fake P/D backends."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from uvicorn.protocols.http.h11_impl import H11Protocol


class ServerThread:
    """`with ServerThread(app) as server: server.url` serves `app` on 127.0.0.1 until exit."""

    def __init__(self, app: Any, port: int = 0, http: type[H11Protocol] | None = None) -> None:
        """`port`: 0 picks a free one; a given port serves a restarted instance at its old URL.
        `http`: the HTTP protocol class (default uvicorn's h11 one)."""
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", http=http or "h11")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


def closes_idle_connections(after_s: float, reset: bool = False) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol, except that a keep-alive connection idle for `after_s` seconds
    is closed, unanswered, the moment the next request arrives on it: the keep-alive race at its
    worst, every time (a server whose idle timer fires just as the client reuses the connection).
    `reset`: closed with a TCP reset instead of a FIN."""

    class RacingKeepAlive(H11Protocol):
        idle_since: float | None = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.idle_since = time.monotonic()

        def data_received(self, data: bytes) -> None:
            if self.idle_since is not None and time.monotonic() - self.idle_since >= after_s:
                self._unset_keepalive_if_required()
                if reset:
                    sock = self.transport.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.transport.abort()
                else:
                    self.transport.close()
                return
            self.idle_since = None
            super().data_received(data)

    return RacingKeepAlive


def closed_port_url() -> str:
    """A loopback URL nobody listens on (the port was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@dataclass
class FakeBackend:
    """A P or D that records what it receives and answers as told.

    mode: "ok" | "error" (500) | "bad_request" (`error_status`, 400 by default, an OpenAI error
    body naming `error_param`) | "slow" (sleeps `delay` before answering) | "no_params" (P
    answers without kv_transfer_params).
    """

    name: str
    mode: str = "ok"
    error_status: int = 400
    error_param: str = "temperature"
    delay: float = 0.0
    chunk_delay: float = 0.0
    answered: int = 0  # requests answered (after `delay`)
    num_chunks: int = 3
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)
    healthy: bool = True
    health_delay: float = 0.0  # seconds /health takes to answer
    # Its /v1/models card: a kvrelay instance's connector ({"kv_connector", "transfer_mode"}),
    # and a context length; None: not said (as vLLM does not say the first).
    kv_transfer: dict[str, Any] | None = None
    max_model_len: int | None = None

    def kv_transfer_params(self, request_id: str) -> dict[str, Any]:
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.name,
                "remote_request_id": request_id, "remote_block_ids": [3, 4],
                "remote_host": "127.0.0.1", "remote_port": 5555, "tp_size": 1,
                "remote_num_tokens": 20}

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        @app.post("/v1/completions")
        async def generate(request: Request) -> Response:
            body = await request.json()
            self.requests.append(body)
            self.headers.append(dict(request.headers))
            return await self._answer(body)

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            card: dict[str, Any] = {"id": "fake-model", "object": "model"}
            if self.max_model_len is not None:
                card["max_model_len"] = self.max_model_len
            if self.kv_transfer is not None:
                card["kv_transfer"] = self.kv_transfer
            return JSONResponse({"object": "list", "data": [card]})

        @app.get("/health")
        async def health() -> Response:
            await asyncio.sleep(self.health_delay)
            return Response(status_code=200 if self.healthy else 503)

        return app

    async def _answer(self, body: dict[str, Any]) -> Response:
        if self.mode == "error":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if self.mode == "bad_request":
            return JSONResponse({"error": {"message": f"{self.error_param} is wrong in {self.name}",
                                           "type": "BadRequestError", "param": self.error_param,
                                           "code": self.error_status}}, status_code=self.error_status)
        if self.delay:
            await asyncio.sleep(self.delay)
        self.answered += 1  # past the delay: what a test asks to tell "still busy" from "done"
        if body.get("stream"):
            return StreamingResponse(self._stream(), media_type="text/event-stream")
        answer: dict[str, Any] = {"id": body.get("request_id"), "object": "chat.completion",
                                  "choices": [{"index": 0, "message": {"role": "assistant",
                                                                       "content": f"from {self.name}"}}]}
        if self.mode != "no_params":
            answer["kv_transfer_params"] = self.kv_transfer_params(body.get("request_id", ""))
        return JSONResponse(answer)

    async def _stream(self) -> AsyncIterator[bytes]:
        try:
            for i in range(self.num_chunks):
                if i:
                    await asyncio.sleep(self.chunk_delay)
                chunk = {"choices": [{"index": 0, "delta": {"content": f"tok{i} "}}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        except BaseException:
            self.cancelled.set()
            raise

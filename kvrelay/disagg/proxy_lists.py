"""A list of prompts through the proxy: one P leg and one D leg per prompt, merged back.

The bodies are split and the answers merged by kvrelay.disagg.prompt_list; this module runs
the legs (concurrently) on the proxy and relays the merged answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

import anyio
import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvrelay.disagg import prompt_list
from kvrelay.disagg.backends import Backend
from kvrelay.disagg.legs import REQUEST_ID_HEADER, DecodeLeg, Prefilled, decode_body
from kvrelay.disagg.proxy_metrics import ProxyMetrics
from kvrelay.disagg.routing import PromptBlocks


class LegsProxy(Protocol):
    """What the list handling calls on the proxy (kvrelay.disagg.proxy.DisaggProxy)."""

    metrics: ProxyMetrics

    def headers(self, request_id: str, client_headers: httpx.Headers | None = None) -> dict[str, str]: ...

    async def read_prompt(self, route: str, body: dict[str, Any]) -> PromptBlocks: ...

    async def prefill_or_push(self, route: str, body: dict[str, Any], request_id: str,
                              headers: dict[str, str], prompt: PromptBlocks) -> Prefilled: ...

    async def open_decode(self, route: str, body: dict[str, Any], request_id: str, headers: dict[str, str],
                          prompt: PromptBlocks, source: Backend | None) -> DecodeLeg | Response: ...

    async def close_leg(self, leg: DecodeLeg, outcome: str) -> None: ...

logger = logging.getLogger(__name__)


async def generate_list(proxy: LegsProxy, request: Request, route: str, body: dict[str, Any],
                        prompts: list[Any], request_id: str, client_headers: httpx.Headers) -> Response:
    """One P leg and one D leg per prompt, concurrently; the answers merged in prompt order.
    (A prompt whose P answer is already final still gets its D leg here: merging one answer
    from P into the others' streams is not worth its complexity.)"""
    ids = [f"{request_id}-{k}" for k in range(len(prompts))]
    bodies = [{**body, "prompt": prompt} for prompt in prompts]
    headers = [proxy.headers(rid, client_headers) for rid in ids]
    blocks = await asyncio.gather(*(proxy.read_prompt(route, b) for b in bodies))
    prefilled = await asyncio.gather(*(proxy.prefill_or_push(route, b, rid, h, p)
                                       for b, rid, h, p in zip(bodies, ids, headers, blocks, strict=True)))
    if await request.is_disconnected():
        proxy.metrics.errors.labels(kind="client_disconnected").inc()
        return Response(status_code=499)
    opened = await asyncio.gather(*(
        proxy.open_decode(route, decode_body(b, rid, pre.params), rid, h, p, pre.source)
        for b, rid, pre, h, p in zip(bodies, ids, prefilled, headers, blocks, strict=True)))
    legs = [leg for leg in opened if not isinstance(leg, Response)]
    failed = [leg for leg in opened if isinstance(leg, Response)]
    if failed:  # one prompt's error answers the request, as one instance's would
        for leg in legs:
            await proxy.close_leg(leg, "cancelled")
        return failed[0]
    n = prompt_list.num_choices(body)
    response_id = ("chatcmpl-" if route.endswith("chat/completions") else "cmpl-") + request_id
    response_headers = {REQUEST_ID_HEADER: request_id}
    if not body.get("stream"):
        answers = []
        for leg in legs:
            try:
                answers.append(json.loads(await leg.upstream.aread()))
            finally:
                await proxy.close_leg(leg, "ok")
        return JSONResponse(prompt_list.merge_bodies(answers, n, response_id), headers=response_headers)
    return StreamingResponse(relay_list(proxy, legs, n, response_id, request_id),
                             media_type="text/event-stream", headers=response_headers)


async def relay_list(proxy: LegsProxy, legs: list[DecodeLeg], n: int, response_id: str,
                     request_id: str) -> AsyncIterator[bytes]:
    """The legs' SSE chunks interleaved as they arrive, renumbered; one usage chunk and one
    [DONE] at the end. Closing this (client gone) closes every leg, aborting them on D."""
    queue: asyncio.Queue[tuple[int, dict[str, Any] | None]] = asyncio.Queue()
    outcomes = ["ok"] * len(legs)

    async def pump(k: int, upstream: httpx.Response) -> None:
        try:
            async for line in upstream.aiter_lines():
                event = prompt_list.parse_sse_line(line)
                if isinstance(event, dict):
                    queue.put_nowait((k, event))
        except httpx.TransportError as e:
            outcomes[k] = "error"
            proxy.metrics.errors.labels(kind="decode_stream_broken").inc()
            logger.warning("request %s: decode stream %d broke: %r", request_id, k, e)
        finally:
            queue.put_nowait((k, None))

    tasks = [asyncio.ensure_future(pump(k, leg.upstream)) for k, leg in enumerate(legs)]
    usage: dict[str, Any] | None = None
    last_chunk: dict[str, Any] | None = None
    try:
        remaining = len(legs)
        while remaining:
            k, event = await queue.get()
            if event is None:
                remaining -= 1
            elif prompt_list.is_usage_chunk(event):
                usage = prompt_list.add_usage(usage, event["usage"])
                last_chunk = event
            else:
                chunk = prompt_list.renumber(event, k, n, response_id)
                yield f"data: {json.dumps(chunk)}\n\n".encode()
        if usage is not None and last_chunk is not None:
            yield f"data: {json.dumps({**last_chunk, 'id': response_id, 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"
    except BaseException:
        outcomes = ["cancelled" if o == "ok" else o for o in outcomes]
        proxy.metrics.errors.labels(kind="client_disconnected").inc()
        raise
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
        for leg, outcome in zip(legs, outcomes, strict=True):
            await proxy.close_leg(leg, outcome)

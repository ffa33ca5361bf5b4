"""A list of prompts through the proxy: one P leg and one D leg per prompt, merged back.

The bodies are split and the answers merged by kvrelay.disagg.prompt_list; this module runs
the legs (concurrently) on the proxy and relays the merged answer. A prompt whose P answer is
already final (its one token ends it: kvrelay.disagg.prefill_answer) gets no D leg; P's answer
takes its place in the merge, streamed as `kvrelay serve` would stream it.
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

from kvrelay.disagg import prefill_answer, prompt_list
from kvrelay.disagg.backends import Backend
from kvrelay.disagg.legs import REQUEST_ID_HEADER, DecodeLeg, Prefilled, decode_body, openai_error
from kvrelay.disagg.proxy_metrics import ProxyMetrics
from kvrelay.disagg.routing import PromptBlocks


class LegsProxy(Protocol):
    """What the list handling calls on the proxy (kvrelay.disagg.proxy.DisaggProxy)."""

    metrics: ProxyMetrics

    def headers(self, request_id: str, client_headers: httpx.Headers | None = None) -> dict[str, str]: ...

    async def read_prompt(self, route: str, body: dict[str, Any]) -> PromptBlocks: ...

    def refuse_unfit(self, route: str, body: dict[str, Any], prompt: PromptBlocks) -> Response | None: ...

    async def prefill_or_push(self, route: str, body: dict[str, Any], request_id: str,
                              headers: dict[str, str], prompt: PromptBlocks) -> Prefilled: ...

    async def open_decode(self, route: str, body: dict[str, Any], request_id: str, headers: dict[str, str],
                          prompt: PromptBlocks, source: Backend | None) -> DecodeLeg | Response: ...

    async def close_leg(self, leg: DecodeLeg, outcome: str) -> None: ...

logger = logging.getLogger(__name__)

Chunks = AsyncIterator[dict[str, Any]]  # one prompt's stream chunks, [DONE] left out


async def generate_list(proxy: LegsProxy, request: Request, route: str, body: dict[str, Any],
                        prompts: list[Any], request_id: str, client_headers: httpx.Headers) -> Response:
    """One P leg per prompt, then one D leg for each prompt P did not already finish, all
    concurrently; the answers merged in prompt order."""
    ids = [f"{request_id}-{k}" for k in range(len(prompts))]
    bodies = [{**body, "prompt": prompt} for prompt in prompts]
    headers = [proxy.headers(rid, client_headers) for rid in ids]
    blocks = await asyncio.gather(*(proxy.read_prompt(route, b) for b in bodies))
    for prompt_body, prompt in zip(bodies, blocks, strict=True):
        unfit = proxy.refuse_unfit(route, prompt_body, prompt)
        if unfit is not None:
            return unfit
    prefilled = await asyncio.gather(*(proxy.prefill_or_push(route, b, rid, h, p)
                                       for b, rid, h, p in zip(bodies, ids, headers, blocks, strict=True)))
    refused = [pre.refusal for pre in prefilled if pre.refusal is not None]
    if refused:  # NOTE: the prompts P did compute are freed when their leases run out
        return refused[0]
    if await request.is_disconnected():
        proxy.metrics.errors.labels(kind="client_disconnected").inc()
        return Response(status_code=499)
    finals = {k: pre.final_answer for k, pre in enumerate(prefilled) if pre.final_answer is not None}
    to_decode = [k for k in range(len(prompts)) if k not in finals]
    opened = await asyncio.gather(*(
        proxy.open_decode(route, decode_body(bodies[k], ids[k], prefilled[k].params), ids[k], headers[k],
                          blocks[k], prefilled[k].source)
        for k in to_decode))
    legs = {k: leg for k, leg in zip(to_decode, opened, strict=True) if not isinstance(leg, Response)}
    failed = [leg for leg in opened if isinstance(leg, Response)]
    if failed:  # one prompt's error answers the request, as one instance's would
        for leg in legs.values():
            await proxy.close_leg(leg, "cancelled")
        return failed[0]
    n = prompt_list.num_choices(body)
    response_id = ("chatcmpl-" if route.endswith("chat/completions") else "cmpl-") + request_id
    response_headers = {REQUEST_ID_HEADER: request_id}
    if not body.get("stream"):
        answers: list[dict[str, Any]] = []
        outcome = "error"
        try:
            for k in range(len(prompts)):
                answer = await _read_answer(legs[k]) if k in legs else finals[k]
                if isinstance(answer, str):
                    proxy.metrics.errors.labels(kind="decode_bad_response").inc()
                    logger.warning("request %s: prompt %d: %s", request_id, k, answer)
                    return openai_error(502, f"prompt {k} of the list: {answer}")
                answers.append(answer)
            outcome = "ok"
        finally:
            for leg in legs.values():
                await proxy.close_leg(leg, outcome)
        return JSONResponse(prompt_list.merge_bodies(answers, n, response_id), headers=response_headers)
    streams = [_leg_events(legs[k].upstream) if k in legs else _final_events(route, bodies[k], finals[k])
               for k in range(len(prompts))]
    return StreamingResponse(relay_list(proxy, streams, legs, n, response_id, request_id),
                             media_type="text/event-stream", headers=response_headers)


async def _read_answer(leg: DecodeLeg) -> dict[str, Any] | str:
    """D's non-streamed answer to one prompt, or what is wrong with it."""
    raw = await leg.upstream.aread()
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        return (f"decode instance {leg.backend.url} answered with a body that is not a completion: "
                f"{raw[:80]!r}")
    return answer


async def _leg_events(upstream: httpx.Response) -> Chunks:
    """The chunks of a D leg's SSE stream, as they arrive."""
    async for line in upstream.aiter_lines():
        event = prompt_list.parse_sse_line(line)
        if isinstance(event, dict):
            yield event


async def _final_events(route: str, body: dict[str, Any], answer: dict[str, Any]) -> Chunks:
    """P's final answer to one prompt as the chunks a D leg would have streamed."""
    for event in prefill_answer.stream_events(route, body, answer):
        yield event


async def relay_list(proxy: LegsProxy, streams: list[Chunks], legs: dict[int, DecodeLeg],
                     n: int, response_id: str, request_id: str) -> AsyncIterator[bytes]:
    """Each prompt's chunks (`streams[k]`: prompt k's, from its D leg `legs[k]` or from P's
    final answer) interleaved as they arrive, renumbered; one usage chunk and one [DONE] at the
    end. Closing this (client gone) closes every D leg, aborting them on D."""
    queue: asyncio.Queue[tuple[int, dict[str, Any] | None]] = asyncio.Queue()
    outcomes = dict.fromkeys(legs, "ok")

    async def pump(k: int, stream: Chunks) -> None:
        try:
            async for event in stream:
                queue.put_nowait((k, event))
        except httpx.TransportError as e:
            outcomes[k] = "error"
            proxy.metrics.errors.labels(kind="decode_stream_broken").inc()
            logger.warning("request %s: decode stream %d broke: %r", request_id, k, e)
        finally:
            queue.put_nowait((k, None))

    tasks = [asyncio.ensure_future(pump(k, stream)) for k, stream in enumerate(streams)]
    usage: dict[str, Any] | None = None
    last_chunk: dict[str, Any] | None = None
    try:
        remaining = len(streams)
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
        outcomes = {k: "cancelled" if o == "ok" else o for k, o in outcomes.items()}
        proxy.metrics.errors.labels(kind="client_disconnected").inc()
        raise
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
        for k, leg in legs.items():
            await proxy.close_leg(leg, outcomes[k])

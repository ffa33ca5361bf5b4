"""Async plumbing of the server: several requests' outputs as one stream, the final outputs,
and watching the client while a non-streamed answer is computed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from kvrelay.engine.async_llm import EngineDeadError, RequestFailedError
from kvrelay.outputs import RequestOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")
_DONE = object()


class StreamFailedError(Exception):
    """A request's stream raised: `status` is the HTTP status it maps to."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def status_of(error: Exception) -> int:
    """ValueError: the engine refused the request (400); the engine failed it (500) or is gone (503)."""
    if isinstance(error, EngineDeadError):
        return 503
    return 500 if isinstance(error, RequestFailedError) else 400


async def interleave(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index of the stream, output) as the outputs arrive, until every stream has ended.
    A stream's error is raised as StreamFailedError; closing this closes (aborts) them all."""
    if len(streams) == 1:  # the common case needs no tasks
        try:
            async for out in streams[0]:
                yield 0, out
        except (ValueError, RequestFailedError, EngineDeadError) as e:
            raise StreamFailedError(status_of(e), str(e)) from None
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(k: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((k, out))
            queue.put_nowait((k, _DONE))
        except (ValueError, RequestFailedError, EngineDeadError) as e:
            queue.put_nowait((k, e))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            k, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise StreamFailedError(status_of(item), str(item))
            else:
                yield k, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]  # aborts a request still running


async def final_outputs(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Each stream's final output, in stream order."""
    finals: dict[int, RequestOutput] = {}
    events = interleave(streams)
    try:
        async for k, out in events:
            if out.finished:
                finals[k] = out
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    return [finals[k] for k in range(len(streams))]


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, or cancel it (aborting the requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def client_left() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(client_left())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    logger.info("client disconnected; request aborted")
    return None


class DisconnectAwareStreamingResponse(StreamingResponse):
    """A StreamingResponse that always watches for the client leaving and then cancels the
    stream (whatever ASGI spec version the server speaks), so the request is aborted at once
    instead of when the next chunk fails to send."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async with anyio.create_task_group() as group:
            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client is gone
                finally:
                    group.cancel_scope.cancel()

            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()
        await self.body_iterator.aclose()  # type: ignore[attr-defined]

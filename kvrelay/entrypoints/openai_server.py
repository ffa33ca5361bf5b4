"""The OpenAI-compatible HTTP server of one kvrelay instance: `build_app(async_llm, name)`.

Routes: POST /v1/completions, POST /v1/chat/completions (streamed as SSE ending in
`data: [DONE]`), GET /v1/models, GET /health, GET /metrics.

Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`. Bad input is always
a 4xx naming the field (never a 500), and the server keeps serving:
    400 invalid JSON, wrong types, out-of-range values, prompt too long, bad kv_transfer_params
    401 missing or wrong `Authorization: Bearer <key>` (every route but /health, when a key is set)
    404 unknown model or route
    500 the engine failed the request; 503 the engine thread is gone (/health says so too)

Request ids: the body's `request_id`, else the `X-Request-Id` header, else a random one. An id
already in flight gets a suffix (see kvrelay.engine.async_llm); the response's `id` is
`cmpl-<id>` / `chatcmpl-<id>` with the id the engine used, echoed in the `X-Request-Id` header.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvrelay.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError
from kvrelay.entrypoints.openai_format import ChunkWriter, ResponseContext, full_response, sse
from kvrelay.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ValidationError,
    check_kv_transfer_params,
    describe_validation_error,
)
from kvrelay.metrics.prometheus import ServerMetrics
from kvrelay.outputs import RequestOutput
from kvrelay.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
RequestT = TypeVar("RequestT", CompletionRequest, ChatCompletionRequest)

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "param": param,
                      "code": status}}


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message, e.param), status_code=e.status)


class OpenAIServer:
    """The route logic, kept apart from FastAPI's wiring."""

    def __init__(self, async_llm: AsyncLLM, served_model_name: str, api_key: str | None) -> None:
        self.async_llm = async_llm
        self.served_model_name = served_model_name
        self.model_names = {served_model_name, async_llm.model_name}
        self.api_key = api_key
        self.metrics = ServerMetrics(async_llm.stats)
        async_llm.add_stats_listener(self.metrics.on_engine_stats)

    # ----------------------------------------------------------------------------- checks
    async def check_api_key(self, request: Request) -> None:
        # NOTE: async on purpose: FastAPI runs sync dependencies in a worker thread, and that
        # (non-daemon) thread would hold the process open for seconds after shutdown.
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'")
        if scheme.lower() != "bearer" or token.strip() != self.api_key:
            raise APIError(401, "incorrect API key in the Authorization header")

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.served_model_name!r} (see GET /v1/models)", "model")

    def check_alive(self) -> None:
        reason = self.async_llm.dead_reason
        if reason is not None:
            raise APIError(503, reason)

    # ----------------------------------------------------------------------------- generation
    async def completions(self, request: Request) -> Response:
        body = await _read_json(request)
        req = _parse(CompletionRequest, body)
        self.check_model(req.model)
        params = _to_sampling_params(req)
        prompt = _field_error(lambda: self.async_llm.preprocess(req.single_prompt()), "prompt")
        ctx = ResponseContext("completion", self.served_model_name, params.logprobs,
                              req.include_usage_in_stream)
        return await self._generate(request, req, prompt, params, ctx)

    async def chat_completions(self, request: Request) -> Response:
        body = await _read_json(request)
        req = _parse(ChatCompletionRequest, body)
        self.check_model(req.model)
        params = _to_sampling_params(req)

        def render() -> dict[str, Any]:
            messages = [m.as_template_input() for m in req.messages]
            text = self.async_llm.engine.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt)
            return self.async_llm.preprocess(text)

        prompt = _field_error(render, "messages")
        ctx = ResponseContext("chat", self.served_model_name, params.logprobs if req.logprobs else None,
                              req.include_usage_in_stream)
        return await self._generate(request, req, prompt, params, ctx)

    async def _generate(self, request: Request, req: CompletionRequest | ChatCompletionRequest,
                        prompt: dict[str, Any], params: SamplingParams, ctx: ResponseContext) -> Response:
        _field_error(lambda: check_kv_transfer_params(req.kv_transfer_params), "kv_transfer_params")
        self.check_alive()
        request_id = req.request_id or request.headers.get("x-request-id") or uuid.uuid4().hex
        outputs = self._observed(self.async_llm.generate(prompt, params, request_id, req.kv_transfer_params))
        if req.stream:
            events = self._stream(outputs, ctx)
            return DisconnectAwareStreamingResponse(events, media_type="text/event-stream",
                                                    headers={"X-Request-Id": request_id})
        final = await _unless_disconnected(request, _last(outputs))
        if final is None:  # the client left: the request was aborted, nobody reads this
            return Response(status_code=499)
        if final.outputs[0].finish_reason == "error":
            raise APIError(500, f"the engine failed the request: {final.error or 'unknown error'}")
        return JSONResponse(full_response(ctx, final), headers={"X-Request-Id": final.request_id})

    async def _stream(self, outputs: AsyncIterator[RequestOutput],
                      ctx: ResponseContext) -> AsyncIterator[str]:
        writer = ChunkWriter(ctx)
        try:
            async for out in outputs:
                if out.finished and out.outputs[0].finish_reason == "error":
                    message = f"the engine failed the request: {out.error or 'unknown error'}"
                    yield sse(error_body(500, message))
                    break
                for event in writer.chunks(out):
                    yield event
        except (ValueError, RequestFailedError, EngineDeadError) as e:
            yield sse(error_body(_status_of(e), str(e)))
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]  # aborts the request if unfinished
        yield sse("[DONE]")

    async def _observed(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """Pass outputs through, observing TTFT, inter-token latency and finish reasons."""
        arrival = last = time.monotonic()
        seen_token = False
        outcome = "abort"  # unless a final output or an error says otherwise: the client left
        try:
            async for out in outputs:
                n_new = len(out.outputs[0].delta_token_ids)
                if n_new:
                    now = time.monotonic()
                    if not seen_token:
                        self.metrics.time_to_first_token.observe(now - arrival)
                        seen_token = True
                    else:
                        self.metrics.inter_token_latency.observe((now - last) / n_new)
                    last = now
                if out.finished:
                    outcome = out.outputs[0].finish_reason or "unknown"
                yield out
        except Exception:
            outcome = "error"
            raise
        finally:
            self.metrics.requests_finished.labels(outcome).inc()
            await outputs.aclose()  # type: ignore[attr-defined]

    # ----------------------------------------------------------------------------- other routes
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "kvrelay", "root": self.async_llm.model_name,
            "max_model_len": self.async_llm.max_model_len}]}

    def health(self) -> JSONResponse:
        reason = self.async_llm.dead_reason
        if reason is not None:
            return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok"})


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


def build_app(async_llm: AsyncLLM, served_model_name: str | None = None,
              api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `async_llm`. It does not own the AsyncLLM: shut that down yourself."""
    server = OpenAIServer(async_llm, served_model_name or async_llm.model_name, api_key)
    app = FastAPI(title="kvrelay", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    auth = [Depends(server.check_api_key)]

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"), status_code=500)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        return await server.completions(request)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        return await server.chat_completions(request)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return server.models()

    @app.get("/metrics", dependencies=auth)
    async def metrics() -> Response:
        content, content_type = server.metrics.render()
        return Response(content, media_type=content_type)

    @app.get("/health")
    async def health() -> JSONResponse:
        return server.health()

    return app


# --------------------------------------------------------------------------------- helpers
async def _read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", "body") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", "body")
    return body


def _parse(model: type[RequestT], body: dict[str, Any]) -> RequestT:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        message, param = describe_validation_error(e)
        raise APIError(400, message, param) from None


def _to_sampling_params(req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    try:
        return req.to_sampling_params()
    except ValueError as e:  # SamplingParams names the field first: "top_p must be in (0, 1], got 2.0"
        message = str(e)
        match = re.match(r"[a-z_]+", message)
        param = match.group(0) if match and match.group(0) in type(req).model_fields else None
        raise APIError(400, message, param) from None


def _field_error(fn: Callable[[], T], param: str) -> T:
    """Run `fn`; a ValueError becomes a 400 naming `param`."""
    try:
        return fn()
    except ValueError as e:
        raise APIError(400, f"{param}: {e}" if not str(e).startswith(param) else str(e), param) from None


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    final: RequestOutput | None = None
    try:
        async for out in outputs:
            final = out
    except (ValueError, RequestFailedError, EngineDeadError) as e:
        raise APIError(_status_of(e), str(e)) from None
    assert final is not None and final.finished
    return final


def _status_of(error: Exception) -> int:
    """ValueError: the engine refused the request (400); the engine failed it (500) or is gone (503)."""
    if isinstance(error, EngineDeadError):
        return 503
    return 500 if isinstance(error, RequestFailedError) else 400


async def _unless_disconnected(request: Request, work: Awaitable[RequestOutput]) -> RequestOutput | None:
    """Await `work`, or cancel it (aborting the request) if the client disconnects first."""
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

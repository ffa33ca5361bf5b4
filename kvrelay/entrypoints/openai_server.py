"""The OpenAI-compatible HTTP server of one kvrelay instance: `build_app(async_llm, name)`.

Routes: POST /v1/completions, POST /v1/chat/completions (streamed as SSE ending in
`data: [DONE]`), GET /v1/models, POST /tokenize, POST /detokenize, GET /version, GET /health,
GET /metrics, GET /kv_events (where this instance publishes its KV cache events, for a router),
POST /reset_prefix_cache (vLLM's), and FastAPI's GET /openapi.json and /docs.

Parallel sampling (`n`) and prompt lists: a list in /v1/completions becomes one engine request
per prompt (ids `<id>-<k>`), each with n choices; choice j of prompt k has index k * n + j, and
a stream interleaves the choices as their tokens arrive. Usage counts each prompt once and every
choice's tokens (OpenAI's rule).

Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`. Bad input is always
a 4xx naming the field (never a 500), and the server keeps serving:
    400 invalid JSON, wrong types, out-of-range values, prompt or max_tokens beyond the context,
        fields kvrelay does not implement, bad kv_transfer_params
    401 missing or wrong `Authorization: Bearer <key>` (every route but /health and /metrics, when a
        key is set: kvrelay.entrypoints.auth)
    404 unknown model or route
    500 the engine failed the request; 503 the engine thread is gone (/health says so too)

Request ids: the body's `request_id`, else the `X-Request-Id` header, else a random one. An id
already in flight gets a suffix (see kvrelay.engine.async_llm); the response's `id` is
`cmpl-<id>` / `chatcmpl-<id>` with the id the engine used, echoed in the `X-Request-Id` header.

Data parallelism (kvrelay.engine.data_parallel): the server fronts one engine or several ranks.
Each prompt goes to the rank the engine client picks, or to the one the `X-data-parallel-rank`
header names (vLLM's; 400 when there is no such rank, 503 when it is down); a one-prompt answer
says which rank served it in the same header. /health, /metrics and /kv_events cover every rank.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

import kvrelay
from kvrelay.engine.async_llm import AsyncLLM, EngineDeadError
from kvrelay.engine.data_parallel import RANK_HEADER, DataParallelLLM, RankLeg
from kvrelay.entrypoints.auth import api_key_error
from kvrelay.entrypoints.openai_errors import (
    APIError,
    add_error_handlers,
    context_error,
    error_body,
    read_json_object,
)
from kvrelay.entrypoints.openai_format import ChunkWriter, ResponseContext, full_response, sse
from kvrelay.entrypoints.prompt_tokens import chat_prompt_text, encode_prompt, request_prompt_token_ids
from kvrelay.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    ValidationError,
    check_kv_transfer_params,
    describe_validation_error,
)
from kvrelay.entrypoints.streams import (
    DisconnectAwareStreamingResponse,
    StreamFailedError,
    final_outputs,
    interleave,
    unless_disconnected,
)
from kvrelay.metrics.prometheus import ServerMetrics
from kvrelay.outputs import RequestOutput
from kvrelay.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
RequestT = TypeVar("RequestT", CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)

EngineClient = AsyncLLM | DataParallelLLM  # one engine, or data-parallel ranks behind one endpoint


class OpenAIServer:
    """The route logic, kept apart from FastAPI's wiring."""

    def __init__(self, async_llm: EngineClient, served_model_name: str, api_key: str | None) -> None:
        self.async_llm = async_llm
        self.served_model_name = served_model_name
        self.model_names = {served_model_name, async_llm.model_name}
        self.api_key = api_key
        ranks = async_llm.ranks
        self.metrics = ServerMetrics(ranks[0].stats, [(llm.dp_rank, llm.stats) for llm in ranks
                                                      if llm.dp_rank is not None])
        for llm in ranks:
            llm.add_stats_listener(self.metrics.stats_listener(llm.dp_rank))

    # ----------------------------------------------------------------------------- checks
    async def check_api_key(self, request: Request) -> None:
        # NOTE: async on purpose: FastAPI runs sync dependencies in a worker thread, and that
        # (non-daemon) thread would hold the process open for seconds after shutdown.
        if self.api_key is None:
            return
        problem = api_key_error(request.headers.get("authorization", ""), self.api_key)
        if problem is not None:
            raise APIError(401, problem)

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
        body = await read_json_object(request)
        with self._refusal_releases_remote_kv(body.get("kv_transfer_params"),
                                              lambda: self._body_token_ids("/v1/completions", body)):
            req = _parse(CompletionRequest, body)
            self.check_model(req.model)
            params = _to_sampling_params(req)
            prompts = [self._prompt(p, req.max_output_tokens, "max_tokens", "prompt", req.add_special_tokens,
                                    req.truncate_prompt_tokens) for p in req.prompts()]
        if len(prompts) > 1 and req.kv_transfer_params is not None:
            raise APIError(400, f"kv_transfer_params with a list of {len(prompts)} prompts: each prompt "
                                "needs its own, so send one prompt per request (the kvrelay proxy splits "
                                "lists)", "kv_transfer_params")
        tokenizer = self.async_llm.engine.tokenizer
        echo = [p["prompt"] if p["prompt"] is not None else tokenizer.decode(p["prompt_token_ids"])
                for p in prompts] if req.echo else []
        ctx = ResponseContext("completion", self.served_model_name, params.logprobs,
                              req.include_usage_in_stream, req.continuous_usage_in_stream, params.n,
                              echo, req.echo_only)
        return await self._generate(request, req, prompts, params, ctx)

    async def chat_completions(self, request: Request) -> Response:
        body = await read_json_object(request)
        with self._refusal_releases_remote_kv(body.get("kv_transfer_params"),
                                              lambda: self._body_token_ids("/v1/chat/completions", body)):
            req = _parse(ChatCompletionRequest, body)
            self.check_model(req.model)
            params = _to_sampling_params(req)
            text = _field_error(lambda: self._render_chat(req.messages, req.add_generation_prompt),
                                "messages")
            max_tokens, max_param = req.max_tokens_param
            prompt = self._prompt(text, max_tokens, max_param, "messages", req.add_special_tokens,
                                  req.truncate_prompt_tokens)
        ctx = ResponseContext("chat", self.served_model_name, params.logprobs if req.logprobs else None,
                              req.include_usage_in_stream, req.continuous_usage_in_stream, params.n,
                              [req.echo_text()])
        return await self._generate(request, req, [prompt], params, ctx)

    @contextmanager
    def _refusal_releases_remote_kv(self, params: Any,
                                    token_ids: Callable[[], list[int] | None]) -> Iterator[None]:
        """A request refused here (4xx) whose kv_transfer_params say a prefill instance computed
        its prompt for this one still releases that KV at once, through the connector (as for a
        request aborted before its admission), rather than leaving it held until P's lease ends.
        The params bind the prompt's tokens (`token_ids()`): without them (an unparsable body)
        nothing is released."""
        try:
            yield
        except APIError as e:
            if e.status < 500 and isinstance(params, dict) and params.get("do_remote_prefill"):
                prompt_token_ids = token_ids()
                if prompt_token_ids:
                    self.async_llm.release_remote_kv(prompt_token_ids, params)
            raise

    def _body_token_ids(self, route: str, body: dict[str, Any]) -> list[int] | None:
        return request_prompt_token_ids(self.async_llm.engine.tokenizer, route, body)

    def _render_chat(self, messages: list[Any], add_generation_prompt: bool) -> str:
        return chat_prompt_text(self.async_llm.engine.tokenizer, messages, add_generation_prompt)

    def _prompt(self, prompt: str | list[int], max_tokens: int | None, max_param: str, param: str,
                add_special_tokens: bool, truncate: int | None = None) -> dict[str, Any]:
        """Tokenize and check one prompt against the context: the prompt must leave room for one
        output token, and for all of `max_tokens` when that is set (vLLM's rules and wording).
        `truncate` (truncate_prompt_tokens) keeps the prompt's last tokens; -1 all that fit."""
        token_ids = encode_prompt(self.async_llm.engine.tokenizer, prompt, add_special_tokens)
        limit = self.async_llm.max_model_len
        if truncate is not None:
            fits = limit - (max_tokens if max_tokens is not None else 1)
            if truncate > fits:
                raise APIError(400, f"truncate_prompt_tokens={truncate} cannot be greater than max_model_len "
                                    f"- {max_param} = {fits}; ask for a smaller truncation",
                               "truncate_prompt_tokens")
            keep = fits if truncate == -1 else truncate
            token_ids = token_ids[-keep:] if keep > 0 else []
            prompt = token_ids  # the text no longer matches the tokens
        error = context_error(len(token_ids), max_tokens, limit, param, max_param)
        if error is not None:
            raise error
        _field_error(lambda: self.async_llm.engine.validate_prompt(token_ids), param)
        return {"prompt": prompt if isinstance(prompt, str) else None, "prompt_token_ids": token_ids}

    async def _generate(self, request: Request, req: CompletionRequest | ChatCompletionRequest,
                        prompts: list[dict[str, Any]], params: SamplingParams,
                        ctx: ResponseContext) -> Response:
        _field_error(lambda: check_kv_transfer_params(req.kv_transfer_params), "kv_transfer_params")
        self.check_alive()
        # NOTE: a rank refused (400: none such) after the params were checked releases P's KV too.
        with self._refusal_releases_remote_kv(req.kv_transfer_params, lambda: prompts[0]["prompt_token_ids"]):
            named_rank = _named_rank(request)
            legs = [self._pick_rank(p["prompt_token_ids"], req.kv_transfer_params, named_rank)
                    for p in prompts]
        request_id = req.request_id or request.headers.get("x-request-id") or uuid.uuid4().hex
        if len(prompts) > 1:
            ctx.request_id = request_id
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{k}" for k in range(len(prompts))]
        streams = [self._observed(leg.generate(p, params, rid, req.kv_transfer_params), leg.dp_rank)
                   for leg, p, rid in zip(legs, prompts, ids, strict=True)]
        served_by = legs[0].dp_rank if len(legs) == 1 else None
        rank_header = {} if served_by is None else {RANK_HEADER: str(served_by)}
        if req.stream:
            return DisconnectAwareStreamingResponse(self._stream(streams, ctx),
                                                    media_type="text/event-stream",
                                                    headers={"X-Request-Id": request_id, **rank_header})
        try:
            finals = await unless_disconnected(request, final_outputs(streams))
        except StreamFailedError as e:
            raise APIError(e.status, str(e)) from None
        if finals is None:  # the client left: the requests were aborted, nobody reads this
            return Response(status_code=499)
        for final in finals:
            if any(c.finish_reason == "error" for c in final.outputs):
                raise APIError(500, f"the engine failed the request: {final.error or 'unknown error'}")
        response_id = request_id if len(finals) > 1 else finals[0].request_id
        return JSONResponse(full_response(ctx, finals), headers={"X-Request-Id": response_id, **rank_header})

    def _pick_rank(self, prompt_token_ids: list[int], kv_transfer_params: dict[str, Any] | None,
                   named_rank: int | None) -> AsyncLLM | RankLeg:
        """The engine (rank) that serves one prompt: 400 for a rank that does not exist, 503 for
        one that is down (or when every rank is)."""
        try:
            return self.async_llm.pick_rank(prompt_token_ids, kv_transfer_params, named_rank)
        except ValueError as e:
            raise APIError(400, f"{RANK_HEADER} header: {e}", RANK_HEADER) from None
        except EngineDeadError as e:
            raise APIError(503, str(e)) from None

    async def _stream(self, streams: list[AsyncIterator[RequestOutput]],
                      ctx: ResponseContext) -> AsyncIterator[str]:
        writer = ChunkWriter(ctx)
        events = interleave(streams)
        failed = False
        try:
            async for k, out in events:
                if out.finished and any(c.finish_reason == "error" for c in out.outputs):
                    message = f"the engine failed the request: {out.error or 'unknown error'}"
                    yield sse(error_body(500, message))
                    failed = True
                    break
                for event in writer.chunks(k, out):
                    yield event
        except StreamFailedError as e:
            yield sse(error_body(e.status, str(e)))
            failed = True
        finally:
            await events.aclose()  # type: ignore[attr-defined]  # aborts the requests still running
        usage_chunk = None if failed else writer.usage_chunk()
        if usage_chunk is not None:
            yield usage_chunk
        yield sse("[DONE]")

    async def _observed(self, outputs: AsyncIterator[RequestOutput],
                        dp_rank: int | None = None) -> AsyncIterator[RequestOutput]:
        """Pass one engine request's outputs through, observing TTFT, inter-token latency (per
        step: the time since the previous step that gave this request tokens, over the tokens any
        one choice got) and each choice's finish reason."""
        arrival = last = time.monotonic()
        seen_token = False
        latest: RequestOutput | None = None
        failed = False
        try:
            async for out in outputs:
                latest = out
                n_new = max((len(c.delta_token_ids) for c in out.outputs), default=0)
                if n_new:
                    now = time.monotonic()
                    if not seen_token:
                        self.metrics.of_rank(self.metrics.time_to_first_token, dp_rank).observe(now - arrival)
                        seen_token = True
                    else:
                        self.metrics.of_rank(self.metrics.inter_token_latency, dp_rank).observe(
                            (now - last) / n_new)
                    last = now
                yield out
        except Exception:
            failed = True
            raise
        finally:
            self._count_finished(latest, failed, dp_rank)
            await outputs.aclose()  # type: ignore[attr-defined]

    def _count_finished(self, latest: RequestOutput | None, failed: bool, dp_rank: int | None) -> None:
        """One count per choice: its finish reason; "error" or "abort" (the client left) when the
        request did not finish."""
        choices = latest.outputs if latest is not None else [None]
        for completion in choices:
            if failed:
                outcome = "error"
            elif completion is None or completion.finish_reason is None:
                outcome = "abort"
            else:
                outcome = completion.finish_reason
            self.metrics.of_rank(self.metrics.requests_finished, dp_rank, outcome).inc()

    # ----------------------------------------------------------------------------- other routes
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "kvrelay", "root": self.async_llm.model_name,
            "max_model_len": self.async_llm.max_model_len, "kv_transfer": self._kv_transfer()}]}

    def _kv_transfer(self) -> dict[str, Any] | None:
        """The connector that moves this instance's KV, for a proxy to check its own mode against
        (kvrelay's field; vLLM's card has none). None without a connector."""
        engine = self.async_llm.engine
        config = engine.config.kv_transfer
        if config is None or config.kv_connector is None:
            return None
        return {"kv_connector": config.kv_connector, "kv_role": config.kv_role,
                "transfer_mode": engine.scheduler.connector.transfer_mode}

    async def tokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's /tokenize: a prompt (special tokens added by default) or chat messages (the
        template's text, no special tokens added by default)."""
        req = _parse(TokenizeRequest, await read_json_object(request))
        self.check_model(req.model)
        tokenizer = self.async_llm.engine.tokenizer
        if req.messages is not None:
            messages = req.messages
            text = _field_error(lambda: self._render_chat(messages, req.add_generation_prompt), "messages")
            add_special = bool(req.add_special_tokens)
        else:
            text = req.prompt or ""
            add_special = req.add_special_tokens is not False
        tokens = tokenizer.encode(text, add_special_tokens=add_special)
        body: dict[str, Any] = {"count": len(tokens), "max_model_len": self.async_llm.max_model_len,
                                "tokens": tokens, "token_strs": None}
        if req.return_token_strs:
            body["token_strs"] = [tokenizer.id_to_token(t) for t in tokens]
        return body

    async def detokenize(self, request: Request) -> dict[str, Any]:
        req = _parse(DetokenizeRequest, await read_json_object(request))
        self.check_model(req.model)
        vocab = self.async_llm.engine.spec.vocab_size
        for i, tok in enumerate(req.tokens):
            if not 0 <= tok < vocab:
                raise APIError(400, f"tokens[{i}]={tok} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": self.async_llm.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    async def reset_prefix_cache(self, reset_running_requests: bool, reset_external: bool) -> dict[str, bool]:
        """vLLM's route and answer: forget every cached prefix (on every data-parallel rank);
        `success` is false while blocks are held (requests running, KV held for a peer); retry,
        or reset_running_requests=true (they are preempted and recomputed). reset_external=true:
        the connector's cache too."""
        self.check_alive()
        done = await asyncio.gather(*(llm.call(
            lambda engine: engine.reset_prefix_cache(reset_running_requests, reset_external))
            for llm in self.async_llm.ranks))
        return {"success": all(done)}

    def kv_events(self) -> dict[str, Any]:
        """Where this instance publishes KV events (docs/routing.md): a router subscribes there.
        A wildcard host (tcp://*:5557) means "this instance's host". With data-parallel ranks,
        rank 0's stream at the top and every rank's under "ranks" (each batch also says its rank)."""
        ranks = self.async_llm.ranks
        engine = ranks[0].engine
        config = engine.config.kv_events
        if config is None or not config.publishes:
            return {"enabled": False}
        answer = {"enabled": True, "endpoint": config.endpoint, "replay_endpoint": config.replay_endpoint,
                  "topic": config.topic, "block_size": engine.config.cache.block_size}
        if ranks[0].dp_rank is not None:
            answer["data_parallel_size"] = engine.config.parallel.data_parallel_size
            answer["ranks"] = [{"dp_rank": llm.dp_rank, "endpoint": llm.engine.config.kv_events.endpoint,
                                "replay_endpoint": llm.engine.config.kv_events.replay_endpoint}
                               for llm in ranks]
        return answer

    def health(self) -> JSONResponse:
        status, body = self.async_llm.health()
        return JSONResponse(body, status_code=status)


def build_app(async_llm: EngineClient, served_model_name: str | None = None,
              api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `async_llm` (one engine, or a DataParallelLLM's ranks). It does not
    own it: shut that down yourself."""
    server = OpenAIServer(async_llm, served_model_name or async_llm.model_name, api_key)
    app = FastAPI(title="kvrelay", version=kvrelay.__version__)  # /openapi.json, /docs, /redoc
    app.state.server = server
    auth = [Depends(server.check_api_key)]

    add_error_handlers(app)

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

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> dict[str, Any]:
        return await server.tokenize(request)

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> dict[str, Any]:
        return await server.detokenize(request)

    @app.get("/version", dependencies=auth)
    async def version() -> dict[str, str]:
        return {"version": kvrelay.__version__}

    _add_instance_routes(app, server, auth)
    return app


def _add_instance_routes(app: FastAPI, server: OpenAIServer, auth: list[Any]) -> None:
    """What operators and routers ask of the instance: metrics, KV events, its cache, health."""

    @app.get("/metrics")  # open, as vLLM's: Prometheus scrapes without the key (entrypoints/auth.py)
    async def metrics() -> Response:
        content, content_type = server.metrics.render()
        return Response(content, media_type=content_type)

    @app.post("/reset_prefix_cache", dependencies=auth)
    async def reset_prefix_cache(reset_running_requests: bool = False,
                                 reset_external: bool = False) -> dict[str, bool]:
        return await server.reset_prefix_cache(reset_running_requests, reset_external)

    @app.get("/kv_events", dependencies=auth)
    async def kv_events() -> dict[str, Any]:
        return server.kv_events()

    @app.get("/health")
    async def health() -> JSONResponse:
        return server.health()


# --------------------------------------------------------------------------------- helpers
def _named_rank(request: Request) -> int | None:
    """The data-parallel rank the caller names in vLLM's header, if any; 400 when it is no rank."""
    raw = request.headers.get(RANK_HEADER)
    if raw is None:
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise APIError(400, f"{RANK_HEADER} header: must be a data-parallel rank (an integer), got {raw!r}",
                       RANK_HEADER) from None


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

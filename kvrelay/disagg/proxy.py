"""The P/D proxy: one client request becomes a prefill leg and a decode leg (docs/disaggregation.md).

    client ──POST /v1/chat/completions──> proxy
      1. prefill leg -> a P chosen by the prefill routing policy: the body with max_tokens=1,
         stream=false and kv_transfer_params = PREFILL_KV_TRANSFER_PARAMS. P computes the
         prompt's KV, keeps it, and answers with top-level `kv_transfer_params` saying where D
         can find it.
      2. decode leg  -> a D chosen by the decode policy: the client's own body plus those
         kv_transfer_params. D loads the KV instead of recomputing it and generates; its answer
         (SSE or JSON) is relayed to the client chunk by chunk as it arrives.

Routing (kvrelay.disagg.routing): least-loaded, round-robin, or kv-aware, which reads the
prompt's cached prefix per instance from the instances' KV events. Membership changes at run
time through the admin API and the health checks (pool_manager.py, admin.py).

When P's single token already ends the answer (end of sequence or a stop string), the proxy
answers from P's result and sends no decode leg (prefill_answer.py).

Parallel sampling: P is asked for one sample (n=1), so it computes the prompt once; D gets the
client's n and its choices share the loaded KV through its prefix cache. A list of prompts in
/v1/completions is split into one request per prompt for both legs (proxy_lists.py).

Both legs carry the same request id (body `request_id`, header `X-Request-Id`; `<id>-<k>` for
prompt k of a list). When the prefill leg cannot help (no P, P down, slow, erroring, or
answering without kv_transfer_params) the client's body goes to D alone and D prefills locally:
a fallback, counted in /metrics by reason (the leg itself: prefill_leg.py). What the client got
wrong is not a fallback: P's 4xx for it is the client's answer, and a max_tokens D's context
cannot hold is refused before P computes (client_errors.py). A decode leg that cannot connect is
sent to another D. A client that disconnects closes the decode leg, which aborts the request on
D. A leg that went out on a stale keep-alive connection is sent again on a fresh one
(connections.py), and a request that finds every instance of a role down asks them again before
giving up on it.

The field names are vLLM's, so the proxy also fronts vLLM instances (routed by their own KV
events: docs/routing.md). With no prefill instance there is no P/D: each request goes whole to
one decode instance, chosen as a prefill leg would be (it computes the prompt).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvrelay.disagg import prefill_answer, prefill_leg, prompt_list, proxy_lists
from kvrelay.disagg.admin import AdminAPI, add_admin_routes
from kvrelay.disagg.backends import Backend, NoInstanceError
from kvrelay.disagg.client_errors import context_refusal, passed_on
from kvrelay.disagg.connections import Connections
from kvrelay.disagg.legs import (
    PREFILL_KV_TRANSFER_PARAMS,
    REQUEST_ID_HEADER,
    DecodeLeg,
    Prefilled,
    decode_body,
    openai_error,
    prefill_body,
)
from kvrelay.disagg.pool_manager import PoolManager
from kvrelay.disagg.proxy_config import ProxyConfig
from kvrelay.disagg.proxy_metrics import ProxyMetrics
from kvrelay.disagg.push_mode import push_decode_params
from kvrelay.disagg.routing import Decision, PromptBlocks, PromptReader
from kvrelay.entrypoints.openai_errors import APIError, add_error_handlers, read_json_object

__all__ = ["PREFILL_KV_TRANSFER_PARAMS", "DisaggProxy", "ProxyConfig", "build_app", "decode_body",
           "prefill_body"]

logger = logging.getLogger(__name__)


class DisaggProxy:
    """State shared by every request: the pools, one HTTP client, the metrics."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.manager = PoolManager(config)
        self.prefill, self.decode = self.manager.prefill, self.manager.decode
        self.metrics = ProxyMetrics()
        self.metrics.watch_pools(self.manager)
        self.prompts = PromptReader.for_model(config.model, config.tokenizer) if config.kv_aware \
            else PromptReader(None)
        self._connections: Connections | None = None
        self._prefill_tasks: set[asyncio.Task[None]] = set()  # push mode: legs nobody awaits

    async def start(self) -> None:
        timeout = httpx.Timeout(self.config.decode_timeout, connect=self.config.connect_timeout)
        self._connections = Connections(
            self.config.max_connections, self.config.keepalive_expiry, timeout,
            on_bytes=self.manager.note_bytes,
            on_stale=lambda source: self.metrics.stale_retries.labels(backend=source).inc())
        try:
            await self.manager.start(self._connections)
        except BaseException:  # an instance refused (another transfer mode): nothing is left open
            await self.close()
            raise
        urls = [b.url for b in self.manager.members()]
        probe_headers = self.headers("kvrelay-tokenizer-check")
        if not await self.prompts.agrees_with(self.connections.checks, urls, probe_headers,
                                              self.config.health_timeout):
            self.prompts = PromptReader(None)

    async def close(self) -> None:
        for task in list(self._prefill_tasks):
            task.cancel()
        await asyncio.gather(*self._prefill_tasks, return_exceptions=True)
        await self.manager.close()
        if self._connections is not None:
            await self._connections.aclose()
            self._connections = None

    @property
    def connections(self) -> Connections:
        if self._connections is None:
            raise RuntimeError("DisaggProxy.start() was not called (the app's lifespan runs it)")
        return self._connections

    @property
    def client(self) -> httpx.AsyncClient:
        """The pooled client (keep-alive connections, shared by the legs)."""
        return self.connections.pooled

    async def post(self, url: str, body: dict[str, Any], headers: dict[str, str],
                   stream: bool = False) -> httpx.Response:
        """POST a leg through the pool (a stale pooled connection is retried on a fresh one)."""
        request = self.client.build_request("POST", url, json=body, headers=headers)
        return await self.connections.send(request, stream=stream)

    def headers(self, request_id: str, client_headers: httpx.Headers | None = None) -> dict[str, str]:
        headers = {REQUEST_ID_HEADER: request_id, "Accept-Encoding": "identity"}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        elif client_headers is not None and "authorization" in client_headers:
            headers["Authorization"] = client_headers["authorization"]
        return headers

    async def read_prompt(self, route: str, body: dict[str, Any]) -> PromptBlocks:
        """The prompt's tokens and block hashes (kv-aware routing only: tokenizing costs)."""
        if self.prompts.tokenizer is None:
            return PromptBlocks(None)
        return await asyncio.to_thread(self.prompts.read, route, body)

    def count_decision(self, role: str, decision: Decision) -> None:
        policy = self.manager.pools[role].policy.name
        self.metrics.decisions.labels(role=role, policy=policy, reason=decision.reason).inc()

    # ------------------------------------------------------------------ generation routes

    async def generate(self, request: Request, route: str) -> Response:
        self.metrics.requests.labels(route=route).inc()
        try:
            body = await read_json_object(request)
        except APIError as e:
            self.metrics.errors.labels(kind="bad_request").inc()
            return openai_error(e.status, e.message, e.param)
        request_id = f"kvrelay-{uuid.uuid4().hex}"
        client_headers = httpx.Headers(dict(request.headers))
        prompts = prompt_list.split_prompts(route, body)
        if prompts is not None:
            return await proxy_lists.generate_list(self, request, route, body, prompts, request_id,
                                                   client_headers)
        headers = self.headers(request_id, client_headers)
        prompt = await self.read_prompt(route, body)
        unfit = self.refuse_unfit(route, body, prompt)
        if unfit is not None:
            return unfit
        prefilled = await self.prefill_or_push(route, body, request_id, headers, prompt)
        if prefilled.refusal is not None:
            return prefilled.refusal
        if prefilled.final_answer is not None:
            return self._answer_from_prefill(route, body, prefilled.final_answer, request_id)
        if await request.is_disconnected():
            self.metrics.errors.labels(kind="client_disconnected").inc()
            return Response(status_code=499)
        return await self._decode(route, decode_body(body, request_id, prefilled.params), request_id,
                                  headers, prompt, prefilled.source)

    def refuse_unfit(self, route: str, body: dict[str, Any], prompt: PromptBlocks) -> Response | None:
        """D's refusal of a prompt and max_tokens its context cannot hold, before P computes
        (client_errors.py); where the proxy cannot tell, D refuses, releasing P's KV at once."""
        error = context_refusal(route, body, prompt.token_ids, self.decode.candidates())
        if error is None:
            return None
        self.count_client_error("proxy", error.status)
        return openai_error(error.status, error.message, error.param)

    def count_client_error(self, by: str, status: int) -> None:
        self.metrics.client_errors.labels(by=by, status=str(status)).inc()

    def _answer_from_prefill(self, route: str, body: dict[str, Any], answer: dict[str, Any],
                             request_id: str) -> Response:
        headers = {REQUEST_ID_HEADER: request_id}
        if body.get("stream"):
            return StreamingResponse(prefill_answer.streamed(route, body, answer),
                                     media_type="text/event-stream", headers=headers)
        return JSONResponse(answer, headers=headers)

    async def prefill_or_push(self, route: str, body: dict[str, Any], request_id: str,
                              headers: dict[str, str], prompt: PromptBlocks) -> Prefilled:
        """D's kv_transfer_params: after P's answer (pull), or at once with P's leg started
        beside D's (push: D's leg goes out first, when the caller opens it). Without P/D (no
        prefill pool) D computes the prompt: no prefill leg, and no fallback either."""
        if self.config.aggregated:
            return Prefilled(None)
        try:
            decision = await self.manager.choose("prefill", prompt)
        except NoInstanceError as e:
            self.metrics.fallbacks.labels(reason="no_prefill_instance").inc()
            logger.warning("request %s: %s; decoding on D alone", request_id, e)
            return Prefilled(None)
        self.count_decision("prefill", decision)
        if self.config.transfer_mode == "pull":
            return await prefill_leg.pull(self, decision, route, body, request_id, headers, prompt)
        self.prefill.start_leg(decision)
        task = asyncio.ensure_future(prefill_leg.push(self, decision, route, body, request_id, headers))
        self._prefill_tasks.add(task)
        task.add_done_callback(self._prefill_tasks.discard)
        assert decision.backend.kv_address is not None  # PoolManager/admin insist on it in push mode
        return Prefilled(push_decode_params(request_id, decision.backend.kv_address))

    # ------------------------------------------------------------------ decode leg

    async def open_decode(self, route: str, body: dict[str, Any], request_id: str, headers: dict[str, str],
                          prompt: PromptBlocks, source: Backend | None) -> DecodeLeg | Response:
        """Send a decode leg: the open leg, or the Response to answer with when no D can take it
        (D's own errors pass through unchanged). A D that refuses the connection is marked down
        and the leg goes to another one (nothing was sent, so nothing runs twice). With every D
        down, they are asked again first; the 503 names each one tried."""
        last_error: Exception | None = None
        for _ in range(max(1, len(self.decode.backends))):
            try:
                decision = await self.manager.choose("decode", prompt)
            except NoInstanceError as e:
                self.metrics.errors.labels(kind="no_decode_instance").inc()
                return openai_error(503, f"{e}; retry later" if last_error is None else
                                    f"every decode instance is unreachable (last: {last_error!r}); {e}")
            self.count_decision("decode", decision)
            self.decode.start_leg(decision)
            if source is not None:
                source.readers += 1
            if self.config.aggregated and self.manager.index is not None:
                self.manager.index.expect(decision.backend.url, request_id, prompt)  # D computes it
            try:
                upstream = await self.post(decision.backend.url + route, body, headers, stream=True)
            except httpx.TransportError as e:
                self._end_decode(decision, source, "error", request_id)
                self.metrics.errors.labels(kind="decode_unreachable").inc()
                logger.warning("request %s: decode leg to %s failed: %r", request_id, decision.backend.url, e)
                if not isinstance(e, httpx.ConnectError):
                    return openai_error(502, f"decode instance {decision.backend.url} is unreachable: {e!r}")
                self.manager.leg_failed(decision.backend, "decode leg", e)
                last_error = e
                continue
            leg = DecodeLeg(decision, upstream, source)
            if upstream.status_code >= 400:
                return await self._refused(leg, request_id)
            return leg
        return openai_error(502, f"every decode instance is unreachable (last: {last_error!r})")

    async def _refused(self, leg: DecodeLeg, request_id: str) -> Response:
        upstream = leg.upstream
        try:
            await upstream.aread()
        finally:
            await self.close_leg(leg, "error")
        self.metrics.errors.labels(kind=f"decode_http_{upstream.status_code}").inc()
        return passed_on(upstream, request_id)

    async def _decode(self, route: str, body: dict[str, Any], request_id: str, headers: dict[str, str],
                      prompt: PromptBlocks, source: Backend | None) -> Response:
        """Send the decode leg and relay D's answer as it arrives."""
        leg = await self.open_decode(route, body, request_id, headers, prompt, source)
        if isinstance(leg, Response):
            return leg
        return StreamingResponse(self._relay(leg, request_id), status_code=leg.upstream.status_code,
                                 media_type=leg.upstream.headers.get("content-type", "application/json"),
                                 headers={REQUEST_ID_HEADER: request_id})

    async def close_leg(self, leg: DecodeLeg, outcome: str) -> None:
        # NOTE: shielded, because a cancelled scope would otherwise abort the close itself.
        with anyio.CancelScope(shield=True):
            await leg.upstream.aclose()
        request_id = leg.upstream.request.headers.get(REQUEST_ID_HEADER)
        self._end_decode(leg.decision, leg.source, outcome, request_id)

    def _end_decode(self, decision: Decision, source: Backend | None, outcome: str,
                    request_id: str | None = None) -> None:
        if self.config.aggregated and self.manager.index is not None and request_id is not None:
            # NOTE: no usage to check the events against (a stream's comes last, if asked for).
            self.manager.index.settle(decision.backend.url, request_id, 0.0, None, None)
        self.decode.end_leg(decision)
        if source is not None:
            source.readers -= 1
        self.metrics.legs.labels(leg="decode", backend=decision.backend.url, outcome=outcome).inc()
        self.manager.reap()

    async def _relay(self, leg: DecodeLeg, request_id: str) -> AsyncIterator[bytes]:
        """D's bytes as they arrive. Closing here (also on client disconnect) aborts D's request."""
        outcome = "ok"
        try:
            async for chunk in leg.upstream.aiter_raw():
                yield chunk
        except httpx.TransportError as e:
            outcome = "error"
            self.metrics.errors.labels(kind="decode_stream_broken").inc()
            logger.warning("request %s: decode stream from %s broke: %r", request_id, leg.backend.url, e)
        except BaseException:  # cancelled: the client went away
            outcome = "cancelled"
            self.metrics.errors.labels(kind="client_disconnected").inc()
            raise
        finally:
            await self.close_leg(leg, outcome)

    # ------------------------------------------------------------------ other routes

    async def models(self, request: Request) -> Response:
        """GET /v1/models, answered by a decode instance."""
        try:
            backend = (await self.manager.choose("decode")).backend
        except NoInstanceError as e:
            return openai_error(503, str(e))
        headers = self.headers(f"kvrelay-{uuid.uuid4().hex}", httpx.Headers(dict(request.headers)))
        try:
            upstream = await self.connections.send(self.client.build_request(
                "GET", backend.url + "/v1/models", headers=headers, timeout=self.config.health_timeout * 5))
        except httpx.TransportError as e:
            self.metrics.errors.labels(kind="decode_unreachable").inc()
            return openai_error(502, f"decode instance {backend.url} is unreachable: {e!r}")
        return Response(upstream.content, status_code=upstream.status_code,
                        media_type=upstream.headers.get("content-type", "application/json"))

    async def health(self) -> JSONResponse:
        """Every backend's /health. 200 while some D is healthy (P being optional: fallback)."""
        checks = {name: await asyncio.gather(*(self._check(b) for b in pool.backends))
                  for name, pool in self.manager.pools.items()}
        decode_ok = any(c["healthy"] for c in checks["decode"])
        prefill_ok = all(c["healthy"] for c in checks["prefill"])
        decode_all = all(c["healthy"] for c in checks["decode"])
        status = "ok" if decode_ok and prefill_ok and decode_all else "degraded" if decode_ok else "down"
        return JSONResponse({"status": status, **checks}, status_code=200 if decode_ok else 503)

    async def _check(self, backend: Backend) -> dict[str, Any]:
        report: dict[str, Any] = {"url": backend.url, "healthy": False, "in_flight": backend.in_flight,
                                  "state": backend.state.value}
        result = await self.manager.check(backend.url)
        report["healthy"] = result.healthy
        if result.error is not None:
            report["error"] = result.error
        self.metrics.backend_up.labels(backend=backend.url).set(1 if result.healthy else 0)
        return report


def build_app(config: ProxyConfig) -> FastAPI:
    """The proxy as an ASGI app (run it with uvicorn, or `kvrelay proxy`)."""
    proxy = DisaggProxy(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.close()

    app = FastAPI(title="kvrelay P/D proxy", lifespan=lifespan)
    app.state.proxy = proxy
    add_error_handlers(app)
    add_admin_routes(app, AdminAPI(proxy.manager, config.admin_key))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.generate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.generate(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.models(request)

    @app.get("/health")
    async def health() -> JSONResponse:
        return await proxy.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(proxy.metrics.render(), media_type=proxy.metrics.content_type)

    return app

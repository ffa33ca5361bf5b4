"""The P/D proxy: one client request becomes a prefill leg and a decode leg (docs/disaggregation.md).

    client ──POST /v1/chat/completions──> proxy
      1. prefill leg -> least-loaded P: the body with max_tokens=1, stream=false and
         kv_transfer_params = PREFILL_KV_TRANSFER_PARAMS. P computes the prompt's KV, keeps it,
         and answers with top-level `kv_transfer_params` saying where D can find it.
      2. decode leg  -> least-loaded D: the client's own body plus those kv_transfer_params.
         D loads the KV instead of recomputing it and generates; its answer (SSE or JSON) is
         relayed to the client chunk by chunk as it arrives.

Parallel sampling: P is asked for one sample (n=1), so it computes the prompt once; D gets the
client's n and its choices share the loaded KV through its prefix cache. A list of prompts in
/v1/completions is split into one request per prompt for both legs, run concurrently, and merged
back (kvrelay.disagg.prompt_list): P computes each prompt once and D gets each prompt's own
kv_transfer_params.

Both legs carry the same request id (body `request_id`, header `X-Request-Id`; `<id>-<k>` for
prompt k of a list). When the prefill
leg cannot help (P down, slow, erroring, or answering without kv_transfer_params) the client's
body goes to D alone and D prefills locally: a fallback, counted in /metrics by reason. A client
that disconnects closes the decode leg, which aborts the request on D.

The field names are vLLM's, so the proxy also fronts vLLM instances.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvrelay.disagg import prompt_list
from kvrelay.disagg.backends import Backend, BackendPool
from kvrelay.disagg.proxy_metrics import ProxyMetrics
from kvrelay.disagg.push_mode import check_push_config, push_decode_params, push_prefill_params

logger = logging.getLogger(__name__)

# What the prefill leg asks of P: compute the prompt, keep its KV for a remote decoder.
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

REQUEST_ID_HEADER = "X-Request-Id"
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class ProxyConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    api_key: str | None = None  # sent to the backends as `Authorization: Bearer`
    prefill_timeout: float = 60.0  # seconds for the whole prefill leg before falling back
    decode_timeout: float = 600.0  # seconds the decode leg may stay silent between chunks
    connect_timeout: float = 5.0
    health_timeout: float = 2.0
    max_connections: int = 512
    # "push" (NixlPushConnector clusters): both legs start at once; see push_mode.py. Needs each
    # prefill instance's KV side-channel address ("host:port"), in the order of prefill_urls.
    transfer_mode: str = "pull"
    prefill_kv_addresses: tuple[str, ...] = ()


def prefill_body(body: dict[str, Any], request_id: str) -> dict[str, Any]:
    """The prefill leg: the client's body reduced to one non-streamed token, asking P to keep KV."""
    leg = dict(body)
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg.pop("min_tokens", None)  # a minimum above one token would make P reject the leg
    if leg.get("n") not in (None, 1):
        leg["n"] = 1  # one sample computes the prompt; D draws the n choices
    leg.pop("best_of", None)
    leg["stream"] = False
    leg.pop("stream_options", None)
    leg["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    leg["request_id"] = request_id
    return leg


def decode_body(body: dict[str, Any], request_id: str,
                kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode leg: the client's body as sent (stream flag kept) plus P's kv_transfer_params.

    Without params (a fallback) any client-supplied kv_transfer_params are dropped too, so D
    surely prefills locally.
    """
    leg = dict(body)
    leg.pop("kv_transfer_params", None)
    if kv_transfer_params is not None:
        leg["kv_transfer_params"] = kv_transfer_params
    leg["request_id"] = request_id
    return leg


def openai_error(status: int, message: str, error_type: str = "proxy_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": error_type, "param": None,
                                   "code": status}}, status_code=status)


class DisaggProxy:
    """State shared by every request: the pools, one HTTP client, the metrics."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefill = BackendPool("prefill", config.prefill_urls)
        self.decode = BackendPool("decode", config.decode_urls)
        self.metrics = ProxyMetrics()
        self._client: httpx.AsyncClient | None = None
        self.kv_addresses = check_push_config(config.transfer_mode, config.prefill_urls,
                                              config.prefill_kv_addresses)
        self._prefill_tasks: set[asyncio.Task[None]] = set()  # push mode: legs nobody awaits

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=self.config.max_connections,
                              max_keepalive_connections=min(64, self.config.max_connections))
        timeout = httpx.Timeout(self.config.decode_timeout, connect=self.config.connect_timeout)
        # NOTE: no env proxies (trust_env=False): legs go straight to the loopback backends.
        self._client = httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)

    async def close(self) -> None:
        for task in list(self._prefill_tasks):
            task.cancel()
        await asyncio.gather(*self._prefill_tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("DisaggProxy.start() was not called (the app's lifespan runs it)")
        return self._client

    def _headers(self, request_id: str, client_headers: httpx.Headers | None = None) -> dict[str, str]:
        headers = {REQUEST_ID_HEADER: request_id, "Accept-Encoding": "identity"}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        elif client_headers is not None and "authorization" in client_headers:
            headers["Authorization"] = client_headers["authorization"]
        return headers

    # ------------------------------------------------------------------ generation routes

    async def generate(self, request: Request, route: str) -> Response:
        self.metrics.requests.labels(route=route).inc()
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            self.metrics.errors.labels(kind="bad_request").inc()
            return openai_error(400, f"request body is not valid JSON: {e}", "BadRequestError")
        if not isinstance(body, dict):
            self.metrics.errors.labels(kind="bad_request").inc()
            return openai_error(400, f"request body must be a JSON object, got {type(body).__name__}",
                                "BadRequestError")
        request_id = f"kvrelay-{uuid.uuid4().hex}"
        client_headers = httpx.Headers(dict(request.headers))
        prompts = prompt_list.split_prompts(route, body)
        if prompts is not None:
            return await self._generate_list(request, route, body, prompts, request_id, client_headers)
        headers = self._headers(request_id, client_headers)
        kv_transfer_params = await self._prefill_or_push(route, body, request_id, headers)
        if await request.is_disconnected():
            self.metrics.errors.labels(kind="client_disconnected").inc()
            return Response(status_code=499)
        return await self._decode(route, decode_body(body, request_id, kv_transfer_params),
                                  request_id, headers)

    async def _generate_list(self, request: Request, route: str, body: dict[str, Any], prompts: list[Any],
                             request_id: str, client_headers: httpx.Headers) -> Response:
        """One P leg and one D leg per prompt, concurrently; the answers merged in prompt order."""
        ids = [f"{request_id}-{k}" for k in range(len(prompts))]
        bodies = [{**body, "prompt": prompt} for prompt in prompts]
        headers = [self._headers(rid, client_headers) for rid in ids]
        params = await asyncio.gather(*(self._prefill_or_push(route, b, rid, h)
                                        for b, rid, h in zip(bodies, ids, headers, strict=True)))
        if await request.is_disconnected():
            self.metrics.errors.labels(kind="client_disconnected").inc()
            return Response(status_code=499)
        opened = await asyncio.gather(*(
            self._open_decode(route, decode_body(b, rid, p), rid, h)
            for b, rid, p, h in zip(bodies, ids, params, headers, strict=True)))
        legs = [leg for leg in opened if not isinstance(leg, Response)]
        failed = [leg for leg in opened if isinstance(leg, Response)]
        if failed:  # one prompt's error answers the request, as one instance's would
            for backend, upstream in legs:
                await self._close_leg(backend, upstream, "cancelled")
            return failed[0]
        n = prompt_list.num_choices(body)
        response_id = ("chatcmpl-" if route.endswith("chat/completions") else "cmpl-") + request_id
        response_headers = {REQUEST_ID_HEADER: request_id}
        if not body.get("stream"):
            answers = []
            for backend, upstream in legs:
                try:
                    answers.append(json.loads(await upstream.aread()))
                finally:
                    await self._close_leg(backend, upstream, "ok")
            return JSONResponse(prompt_list.merge_bodies(answers, n, response_id), headers=response_headers)
        return StreamingResponse(self._relay_list(legs, n, response_id, request_id),
                                 media_type="text/event-stream", headers=response_headers)

    async def _prefill_or_push(self, route: str, body: dict[str, Any], request_id: str,
                               headers: dict[str, str]) -> dict[str, Any] | None:
        """D's kv_transfer_params: after P's answer (pull), or at once with P's leg started
        beside D's (push: D's leg goes out first, when the caller opens it)."""
        if self.config.transfer_mode == "pull":
            return await self._prefill(route, body, request_id, headers)
        backend = self.prefill.acquire()
        task = asyncio.ensure_future(self._push_prefill_leg(backend, route, body, request_id, headers))
        self._prefill_tasks.add(task)
        task.add_done_callback(self._prefill_tasks.discard)
        return push_decode_params(request_id, self.kv_addresses[backend.url])

    async def _push_prefill_leg(self, backend: Backend, route: str, body: dict[str, Any], request_id: str,
                                headers: dict[str, str]) -> None:
        """P's leg of a push; its answer is discarded. A failure is D's to recover from."""
        try:
            leg = {**prefill_body(body, request_id), "kv_transfer_params": push_prefill_params(request_id)}
            with self.metrics.prefill_seconds.time():
                response = await asyncio.wait_for(
                    self.client.post(backend.url + route, json=leg, headers=headers),
                    timeout=self.config.prefill_timeout)
            outcome = "ok" if response.status_code == 200 else f"http_{response.status_code}"
        except (TimeoutError, httpx.TimeoutException):
            outcome = "timeout"
        except httpx.TransportError:
            outcome = "unreachable"
        finally:
            self.prefill.release(backend)
        self.metrics.legs.labels(leg="prefill", backend=backend.url,
                                 outcome="ok" if outcome == "ok" else "fallback").inc()
        if outcome != "ok":
            self.metrics.fallbacks.labels(reason=outcome).inc()
            logger.warning("request %s: push prefill leg to %s gave %s; D prefills alone once it sees "
                           "no progress", request_id, backend.url, outcome)

    async def _prefill(self, route: str, body: dict[str, Any], request_id: str,
                       headers: dict[str, str]) -> dict[str, Any] | None:
        """Run the prefill leg; P's kv_transfer_params, or None after counting a fallback."""
        with self.prefill.lease() as backend:
            with self.metrics.prefill_seconds.time():
                outcome, params = await self._post_prefill(backend, route, body, request_id, headers)
        self.metrics.legs.labels(leg="prefill", backend=backend.url,
                                 outcome="ok" if params is not None else "fallback").inc()
        if params is None:
            self.metrics.fallbacks.labels(reason=outcome).inc()
            log = logger.info if outcome == "no_kv_transfer_params" else logger.warning
            log("request %s: prefill leg to %s gave %s; decoding on D alone", request_id,
                backend.url, outcome)
        return params

    async def _post_prefill(self, backend: Backend, route: str, body: dict[str, Any],
                            request_id: str, headers: dict[str, str]) -> tuple[str, dict[str, Any] | None]:
        try:
            response = await asyncio.wait_for(
                self.client.post(backend.url + route, json=prefill_body(body, request_id),
                                 headers=headers),
                timeout=self.config.prefill_timeout)
        except (TimeoutError, httpx.TimeoutException):
            return "timeout", None
        except httpx.TransportError:
            return "unreachable", None
        if response.status_code != 200:
            return f"http_{response.status_code}", None
        try:
            params = response.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            return "bad_response", None
        if not isinstance(params, dict) or not params:
            return "no_kv_transfer_params", None
        return "ok", params

    async def _open_decode(self, route: str, body: dict[str, Any], request_id: str,
                           headers: dict[str, str]) -> tuple[Backend, httpx.Response] | Response:
        """Send a decode leg: the open upstream response, or the Response to answer with when D
        is unreachable or refused (D's own errors pass through unchanged)."""
        backend = self.decode.acquire()
        try:
            upstream = await self.client.send(
                self.client.build_request("POST", backend.url + route, json=body, headers=headers),
                stream=True)
        except httpx.TransportError as e:
            self.decode.release(backend)
            self.metrics.legs.labels(leg="decode", backend=backend.url, outcome="error").inc()
            self.metrics.errors.labels(kind="decode_unreachable").inc()
            logger.warning("request %s: decode leg to %s failed: %r", request_id, backend.url, e)
            return openai_error(502, f"decode instance {backend.url} is unreachable: {e!r}")
        if upstream.status_code >= 400:
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
                self.decode.release(backend)
            self.metrics.legs.labels(leg="decode", backend=backend.url, outcome="error").inc()
            self.metrics.errors.labels(kind=f"decode_http_{upstream.status_code}").inc()
            return Response(content, status_code=upstream.status_code,
                            media_type=upstream.headers.get("content-type", "application/json"),
                            headers={REQUEST_ID_HEADER: request_id})
        return backend, upstream

    async def _decode(self, route: str, body: dict[str, Any], request_id: str,
                      headers: dict[str, str]) -> Response:
        """Send the decode leg and relay D's answer as it arrives."""
        leg = await self._open_decode(route, body, request_id, headers)
        if isinstance(leg, Response):
            return leg
        backend, upstream = leg
        return StreamingResponse(self._relay(upstream, backend, request_id),
                                 status_code=upstream.status_code,
                                 media_type=upstream.headers.get("content-type", "application/json"),
                                 headers={REQUEST_ID_HEADER: request_id})

    async def _close_leg(self, backend: Backend, upstream: httpx.Response, outcome: str) -> None:
        # NOTE: shielded, because a cancelled scope would otherwise abort the close itself.
        with anyio.CancelScope(shield=True):
            await upstream.aclose()
        self.decode.release(backend)
        self.metrics.legs.labels(leg="decode", backend=backend.url, outcome=outcome).inc()

    async def _relay(self, upstream: httpx.Response, backend: Backend,
                     request_id: str) -> AsyncIterator[bytes]:
        """D's bytes as they arrive. Closing here (also on client disconnect) aborts D's request."""
        outcome = "ok"
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.TransportError as e:
            outcome = "error"
            self.metrics.errors.labels(kind="decode_stream_broken").inc()
            logger.warning("request %s: decode stream from %s broke: %r", request_id, backend.url, e)
        except BaseException:  # cancelled: the client went away
            outcome = "cancelled"
            self.metrics.errors.labels(kind="client_disconnected").inc()
            raise
        finally:
            await self._close_leg(backend, upstream, outcome)

    async def _relay_list(self, legs: list[tuple[Backend, httpx.Response]], n: int, response_id: str,
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
                self.metrics.errors.labels(kind="decode_stream_broken").inc()
                logger.warning("request %s: decode stream %d broke: %r", request_id, k, e)
            finally:
                queue.put_nowait((k, None))

        tasks = [asyncio.ensure_future(pump(k, upstream)) for k, (_, upstream) in enumerate(legs)]
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
            self.metrics.errors.labels(kind="client_disconnected").inc()
            raise
        finally:
            for task in tasks:
                task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)
            for (backend, upstream), outcome in zip(legs, outcomes, strict=True):
                await self._close_leg(backend, upstream, outcome)

    # ------------------------------------------------------------------ other routes

    async def models(self, request: Request) -> Response:
        """GET /v1/models, answered by a decode instance."""
        backend = self.decode.pick()
        headers = self._headers(f"kvrelay-{uuid.uuid4().hex}", httpx.Headers(dict(request.headers)))
        try:
            upstream = await self.client.get(backend.url + "/v1/models", headers=headers,
                                             timeout=self.config.health_timeout * 5)
        except httpx.TransportError as e:
            self.metrics.errors.labels(kind="decode_unreachable").inc()
            return openai_error(502, f"decode instance {backend.url} is unreachable: {e!r}")
        return Response(upstream.content, status_code=upstream.status_code,
                        media_type=upstream.headers.get("content-type", "application/json"))

    async def health(self) -> JSONResponse:
        """Every backend's /health. 200 while some D is healthy (P being optional: fallback)."""
        pools = {"prefill": self.prefill, "decode": self.decode}
        checks = {name: await asyncio.gather(*(self._check(b) for b in pool.backends))
                  for name, pool in pools.items()}
        decode_ok = any(c["healthy"] for c in checks["decode"])
        prefill_ok = all(c["healthy"] for c in checks["prefill"])
        decode_all = all(c["healthy"] for c in checks["decode"])
        status = "ok" if decode_ok and prefill_ok and decode_all else "degraded" if decode_ok else "down"
        return JSONResponse({"status": status, **checks}, status_code=200 if decode_ok else 503)

    async def _check(self, backend: Backend) -> dict[str, Any]:
        report: dict[str, Any] = {"url": backend.url, "healthy": False, "in_flight": backend.in_flight}
        try:
            response = await self.client.get(backend.url + "/health", timeout=self.config.health_timeout)
            report["healthy"] = response.status_code == 200
            if not report["healthy"]:
                report["error"] = f"HTTP {response.status_code}"
        except httpx.TransportError as e:
            report["error"] = repr(e)
        self.metrics.backend_up.labels(backend=backend.url).set(1 if report["healthy"] else 0)
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

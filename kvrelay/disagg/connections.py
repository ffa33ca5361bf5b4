"""The proxy's HTTP connections to its instances (docs/routing.md, "Connections").

Three clients, none of them using environment proxies:

    pooled   legs and other client-driven requests reuse keep-alive connections; an idle one is
             dropped after `keepalive_expiry` seconds, safely below the instances' own keep-alive
             timeout (uvicorn's default, hence vLLM's and `kvrelay serve`'s: 5 s), so the proxy
             rarely offers a request on a connection the server is about to close
    fresh    one new connection per request, closed after it: the one retry of a request whose
             reused connection turned out stale
    checks   the same for health checks and other questions the proxy asks on its own: an
             instance's health never depends on what the legs left in the pool

The keep-alive race that remains: the server closes an idle connection just as the proxy reuses
it. The request then ends without a single byte of an answer ("Server disconnected without
sending a response", or a reset). That is not a dead instance, and the request is sent again at
once on a fresh connection. Sending it again is safe: an HTTP/1.1 server closes a connection
between requests, never after reading one it has not answered, so the first copy was never read;
and if the server died instead, the fresh connection is refused and nothing is sent twice (a
server that died or aborted mid-request cannot still be running it). A failure with any part of
an answer received, a timeout, or a failure on a connection opened for the request is never
retried here.

Bytes arriving from an instance on a leg (pooled or fresh, not checks) are reported to
`on_bytes(origin)`: the health checks count them as proof of life.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from kvrelay.utils import HTTP_KEEP_ALIVE_S

logger = logging.getLogger(__name__)

# uvicorn's default keep-alive timeout: what vLLM (VLLM_HTTP_TIMEOUT_KEEP_ALIVE) and `kvrelay serve`
# (--timeout-keep-alive) close idle connections after unless told otherwise.
SERVER_KEEP_ALIVE_S = float(HTTP_KEEP_ALIVE_S)
KEEPALIVE_EXPIRY_S = 2.0  # the proxy's default: well below SERVER_KEEP_ALIVE_S

# What a server's close looks like to a request that went out on the closed connection.
_STALE_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
_NO_ANSWER = "Server disconnected without sending a response"


def origin(url: httpx.URL | str) -> str:
    """`scheme://host:port` of a URL, the key an instance is known by."""
    url = httpx.URL(url)
    port = f":{url.port}" if url.port is not None else ""
    return f"{url.scheme}://{url.host}{port}"


class ConnectionTrace:
    """httpcore's `trace` extension on one request: whether it opened a connection of its own,
    and whether any part of an answer arrived."""

    def __init__(self) -> None:
        self.connected = False
        self.answered = False

    async def __call__(self, event: str, info: dict[str, Any]) -> None:
        if event.startswith("connection.connect_tcp."):
            self.connected = True
        elif event == "http11.receive_response_headers.complete":
            self.answered = True

    def stale(self, error: httpx.TransportError) -> bool:
        """Whether `error` is a server's close of the reused connection this request went out
        on, before any answer: the request was never read, so it may be sent again."""
        if self.connected or self.answered or not isinstance(error, _STALE_ERRORS):
            return False
        return not isinstance(error, httpx.RemoteProtocolError) or str(error).startswith(_NO_ANSWER)


class Connections:
    """The three clients; `send` retries a stale reused connection once."""

    def __init__(self, max_connections: int, keepalive_expiry: float, timeout: httpx.Timeout,
                 on_bytes: Callable[[str], None], on_stale: Callable[[str], None],
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        """`transport`: every request goes there instead of over the network (a test's ASGI app)."""
        limits = httpx.Limits(max_connections=max_connections,
                              max_keepalive_connections=min(64, max_connections),
                              keepalive_expiry=keepalive_expiry)
        fresh_limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=0)
        pooled = transport or httpx.AsyncHTTPTransport(limits=limits)
        fresh = transport or httpx.AsyncHTTPTransport(limits=fresh_limits)
        # NOTE: no env proxies (trust_env=False): requests go straight to the instances.
        self.pooled = httpx.AsyncClient(transport=_Watched(pooled, on_bytes), timeout=timeout,
                                        trust_env=False)
        self.fresh = httpx.AsyncClient(transport=_Watched(fresh, on_bytes), timeout=timeout,
                                       trust_env=False)
        self.checks = checks_client(max_connections, timeout, transport)
        self._on_stale = on_stale

    async def send(self, request: httpx.Request, stream: bool = False) -> httpx.Response:
        """`request` through the pool; sent once more on a fresh connection when the pooled one
        it went out on was stale (see the module docstring). Raises what the last try raised."""
        trace = ConnectionTrace()
        request.extensions = {**request.extensions, "trace": trace}
        try:
            return await self.pooled.send(request, stream=stream)
        except httpx.TransportError as e:
            if not trace.stale(e):
                raise
            logger.info("%s %s went out on a stale keep-alive connection (%r): sent again on a fresh one",
                        request.method, request.url, e)
            self._on_stale(origin(request.url))
        request.extensions = {k: v for k, v in request.extensions.items() if k != "trace"}
        return await self.fresh.send(request, stream=stream)

    async def aclose(self) -> None:
        for client in (self.pooled, self.fresh, self.checks):
            await client.aclose()


def checks_client(max_connections: int, timeout: httpx.Timeout,
                  transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """The client for checks: a new connection per request, no env proxies (`transport`: as
    in Connections). `kvrelay proxy` asks its instances what they run with one before it serves."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=0)
    return httpx.AsyncClient(transport=transport or httpx.AsyncHTTPTransport(limits=limits),
                             timeout=timeout, trust_env=False)


class _Watched(httpx.AsyncBaseTransport):
    """A transport that reports every chunk of every answer (and its headers) to `on_bytes`."""

    def __init__(self, inner: httpx.AsyncBaseTransport, on_bytes: Callable[[str], None]) -> None:
        self._inner = inner
        self._on_bytes = on_bytes

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        source = origin(request.url)
        self._on_bytes(source)
        return httpx.Response(response.status_code, headers=response.headers,
                              stream=_WatchedStream(response.stream, lambda: self._on_bytes(source)),
                              extensions=response.extensions)

    async def aclose(self) -> None:
        await self._inner.aclose()


class _WatchedStream(httpx.AsyncByteStream):
    def __init__(self, inner: Any, on_chunk: Callable[[], None]) -> None:
        self._inner = inner
        self._on_chunk = on_chunk

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            self._on_chunk()
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()

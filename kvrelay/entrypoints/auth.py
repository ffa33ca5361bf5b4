"""The API key of an OpenAI-compatible server (`--api-key`, or KVRELAY_API_KEY): one check for
`kvrelay serve` and `kvrelay proxy`.

Clients send `Authorization: Bearer <key>`. /health and /metrics stay open, as in vLLM 0.32,
whose key guards only the /v1 routes: a load balancer's health check and a Prometheus scrape
need no key.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from kvrelay.entrypoints.openai_errors import error_body

OPEN_PATHS = frozenset({"/health", "/metrics"})


def api_key_error(authorization: str, api_key: str) -> str | None:
    """Why the `Authorization` header value does not carry `api_key`, or None when it does."""
    if not authorization:
        return "missing API key: send the header 'Authorization: Bearer <key>'"
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        return "incorrect API key in the Authorization header"
    return None


class RequireAPIKey:
    """ASGI middleware: an HTTP request to any path but OPEN_PATHS (and the admin API under
    /admin, which has a key of its own) needs the key; else a 401 in OpenAI's error shape."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS or path.startswith("/admin"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        problem = api_key_error(headers.get("authorization", ""), self.api_key)
        if problem is None:
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(401, problem)).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

"""Requests the client got wrong, answered without a decode leg (counted in
`kvrelay_proxy_client_errors_total{by, status}`):

    by="prefill"  P refused the prefill leg for what the client sent (an empty prompt, a
                  temperature out of range, an unknown model...): P's answer is the client's,
                  as it is; D, sent the same body, would refuse it too
    by="proxy"    a prompt and max_tokens the decode instances' context cannot hold: P is asked
                  for one token and would compute the prompt, so only D would refuse it, after;
                  the proxy refuses it first when it knows the prompt's tokens (kv-aware routing)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import httpx
from fastapi.responses import Response

from kvrelay.disagg.backends import Backend
from kvrelay.disagg.legs import REQUEST_ID_HEADER
from kvrelay.entrypoints.openai_errors import APIError, context_error


def is_client_error(response: httpx.Response) -> bool:
    """P refused the request for what the client sent (a 4xx other than "too slow" or "too
    busy"), not for what the prefill leg adds (its kv_transfer_params)."""
    if not 400 <= response.status_code < 500 or response.status_code in (408, 429):
        return False
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return True
    return not (isinstance(error, dict) and error.get("param") == "kv_transfer_params")


def passed_on(response: httpx.Response, request_id: str) -> Response:
    """A backend's (read) answer as the proxy's own: its status, body and content type."""
    return Response(response.content, status_code=response.status_code,
                    media_type=response.headers.get("content-type", "application/json"),
                    headers={REQUEST_ID_HEADER: request_id})


def context_refusal(route: str, body: dict[str, Any], prompt_tokens: list[int] | None,
                    decode: Iterable[Backend]) -> APIError | None:
    """The refusal a decode instance would give a prompt and max_tokens its context cannot hold
    (vLLM's wording), or None: when it fits the largest context the decode instances said they
    have, or when the prompt's tokens or every context length are unknown."""
    limits = [b.info.max_model_len for b in decode if b.info is not None and b.info.max_model_len]
    if prompt_tokens is None or not limits:
        return None
    param = "messages" if route.endswith("chat/completions") else "prompt"
    max_tokens, max_param = _max_tokens(body, chat=param == "messages")
    return context_error(len(prompt_tokens), max_tokens, max(limits), param, max_param)


def _max_tokens(body: dict[str, Any], chat: bool) -> tuple[int | None, str]:
    """The output limit the server holds the request to and the field that set it (vLLM's
    defaults: 16 for a completion, up to the context for a chat)."""
    for field in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            return value, field
    return (None if chat else 16), "max_tokens"

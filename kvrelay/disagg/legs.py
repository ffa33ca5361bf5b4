"""The two legs' bodies and the proxy's error shape (DESIGN.md section 5, vLLM's field names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import httpx
from fastapi.responses import JSONResponse, Response

from kvrelay.disagg.backends import Backend
from kvrelay.disagg.routing.policies import Decision
from kvrelay.entrypoints.openai_errors import error_response

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


def openai_error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """The proxy's own error answers, shaped exactly as `kvrelay serve`'s."""
    return error_response(status, message, param)


class Prefilled(NamedTuple):
    """What the prefill leg gave: D's kv_transfer_params (None: D prefills alone), P's answer
    when it is already the final one, the P whose KV the decode leg reads, and P's refusal of a
    request the client got wrong (a 4xx: the client's answer, no decode leg)."""

    params: dict[str, Any] | None
    final_answer: dict[str, Any] | None = None
    source: Backend | None = None
    refusal: Response | None = None


@dataclass
class DecodeLeg:
    decision: Decision
    upstream: httpx.Response
    source: Backend | None  # the P it reads KV from, held until the leg ends

    @property
    def backend(self) -> Backend:
        return self.decision.backend

"""The proxy's prefill leg to the P it chose (kvrelay.disagg.proxy decides which, and when).

    pull   P computes the prompt and answers with the kv_transfer_params D reads with; its
           answer settles the P's KV index entry (the data-parallel rank that answered, when it
           has several) and is checked against the predicted prefix hit
    push   P's leg runs beside D's, its answer discarded: D already holds the params

What the prefill leg gives back when it cannot help (no params: a fallback, counted by reason),
when P's one token is already the answer, and when P refuses what the client sent (the client's
answer, as it is: client_errors.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, NamedTuple, Protocol

import httpx
from fastapi.responses import Response

from kvrelay.disagg import prefill_answer
from kvrelay.disagg.backends import Backend
from kvrelay.disagg.client_errors import is_client_error, passed_on
from kvrelay.disagg.legs import Prefilled, prefill_body
from kvrelay.disagg.pool_manager import PoolManager
from kvrelay.disagg.proxy_config import ProxyConfig
from kvrelay.disagg.proxy_metrics import ProxyMetrics
from kvrelay.disagg.push_mode import push_prefill_params
from kvrelay.disagg.routing import Decision, PromptBlocks
from kvrelay.disagg.routing.kv_index import rank_key

logger = logging.getLogger(__name__)

DP_RANK_HEADER = "X-data-parallel-rank"  # which data-parallel rank of an instance answered (vLLM's name)


class PrefillProxy(Protocol):
    """What the prefill leg uses of the proxy (kvrelay.disagg.proxy.DisaggProxy)."""

    config: ProxyConfig
    manager: PoolManager
    metrics: ProxyMetrics

    async def post(self, url: str, body: dict[str, Any], headers: dict[str, str],
                   stream: bool = False) -> httpx.Response: ...

    def count_client_error(self, by: str, status: int) -> None: ...


class PrefillReply(NamedTuple):
    """P's answer to a pull-mode prefill leg."""

    outcome: str  # ok | timeout | unreachable | client_error | http_<status> | bad_response
    answer: dict[str, Any] | None  # None unless P answered 200 with a JSON object
    refusal: Response | None  # P's answer to a client error, passed on as it is
    dp_rank: int = 0  # the data-parallel rank that answered (0 unless P names another)


async def pull(proxy: PrefillProxy, decision: Decision, route: str, body: dict[str, Any],
               request_id: str, headers: dict[str, str], prompt: PromptBlocks) -> Prefilled:
    """Run the prefill leg on the chosen P; a fallback (no params) is counted by reason."""
    backend = decision.backend
    index = proxy.manager.index
    started_at = time.monotonic()
    proxy.manager.prefill.start_leg(decision)
    if index is not None and len(backend.index_keys) == 1:  # with ranks, P picks one: unknown yet
        index.expect(backend.url, request_id, prompt)
    try:
        with proxy.metrics.prefill_seconds.time():
            reply = await _post(proxy, backend, route, body, request_id, headers)
    finally:
        proxy.manager.prefill.end_leg(decision)
    prompt_tokens, cached = usage_tokens(reply.answer)
    if index is not None:  # on the entry of the rank that answered, when P has several
        key = backend.url if len(backend.index_keys) == 1 else rank_key(backend.url, reply.dp_rank)
        index.settle(key, request_id, started_at, prompt_tokens, cached)
        if decision.predicted_hit_tokens is not None and cached is not None:
            # NOTE: cached_tokens counts tier loads too (vLLM's count), which may end in a
            # partial block; a prediction counts full blocks.
            proxy.metrics.observe_prefix_hit(decision.predicted_hit_tokens, index.whole_blocks(key, cached))
    proxy.manager.reap()
    if reply.refusal is not None:
        proxy.metrics.legs.labels(leg="prefill", backend=backend.url, outcome="client_error").inc()
        proxy.count_client_error("prefill", reply.refusal.status_code)
        logger.info("request %s: prefill instance %s refused it with %d: the client's answer, no decode "
                    "leg", request_id, backend.url, reply.refusal.status_code)
        return Prefilled(None, refusal=reply.refusal)
    return _result(proxy, backend, reply.outcome, reply.answer, body, request_id)


def _result(proxy: PrefillProxy, backend: Backend, outcome: str, answer: dict[str, Any] | None,
            body: dict[str, Any], request_id: str) -> Prefilled:
    legs, fallbacks = proxy.metrics.legs, proxy.metrics.fallbacks
    if answer is not None and prefill_answer.can_answer_from_prefill(body, answer):
        legs.labels(leg="prefill", backend=backend.url, outcome="final").inc()
        return Prefilled(None, final_answer=answer)
    params = answer.get("kv_transfer_params") if answer is not None else None
    if not isinstance(params, dict) or not params:
        params = None
        outcome = "no_kv_transfer_params" if outcome == "ok" else outcome
    legs.labels(leg="prefill", backend=backend.url, outcome="ok" if params is not None else "fallback").inc()
    if params is None:
        fallbacks.labels(reason=outcome).inc()
        log = logger.info if outcome == "no_kv_transfer_params" else logger.warning
        log("request %s: prefill leg to %s gave %s; decoding on D alone", request_id, backend.url, outcome)
        return Prefilled(None)
    return Prefilled(params, source=backend)


async def _post(proxy: PrefillProxy, backend: Backend, route: str, body: dict[str, Any], request_id: str,
                headers: dict[str, str]) -> PrefillReply:
    try:
        response = await asyncio.wait_for(
            proxy.post(backend.url + route, prefill_body(body, request_id), headers),
            timeout=proxy.config.prefill_timeout)
    except (TimeoutError, httpx.TimeoutException):
        return PrefillReply("timeout", None, None)
    except httpx.TransportError as e:
        proxy.manager.leg_failed(backend, "prefill leg", e)
        return PrefillReply("unreachable", None, None)
    rank = response.headers.get(DP_RANK_HEADER, "0")
    dp_rank = int(rank) if rank.isdigit() else 0
    if is_client_error(response):
        return PrefillReply("client_error", None, passed_on(response, request_id), dp_rank)
    if response.status_code != 200:
        return PrefillReply(f"http_{response.status_code}", None, None, dp_rank)
    try:
        answer = response.json()
    except ValueError:
        return PrefillReply("bad_response", None, None, dp_rank)
    if not isinstance(answer, dict):
        return PrefillReply("bad_response", None, None, dp_rank)
    return PrefillReply("ok", answer, None, dp_rank)


async def push(proxy: PrefillProxy, decision: Decision, route: str, body: dict[str, Any], request_id: str,
               headers: dict[str, str]) -> None:
    """P's leg of a push (its leg already started on the pool); its answer is discarded. A
    failure is D's to recover from; a client error is D's to answer, sent the same body."""
    backend = decision.backend
    try:
        leg = {**prefill_body(body, request_id), "kv_transfer_params": push_prefill_params(request_id)}
        with proxy.metrics.prefill_seconds.time():
            response = await asyncio.wait_for(proxy.post(backend.url + route, leg, headers),
                                              timeout=proxy.config.prefill_timeout)
        outcome = "ok" if response.status_code == 200 else f"http_{response.status_code}"
        if is_client_error(response):
            outcome = "client_error"
            proxy.count_client_error("prefill", response.status_code)
    except (TimeoutError, httpx.TimeoutException):
        outcome = "timeout"
    except httpx.TransportError as e:
        proxy.manager.leg_failed(backend, "prefill leg", e)
        outcome = "unreachable"
    finally:
        proxy.manager.prefill.end_leg(decision)
        proxy.manager.reap()
    proxy.metrics.legs.labels(leg="prefill", backend=backend.url,
                              outcome=outcome if outcome in ("ok", "client_error") else "fallback").inc()
    if outcome not in ("ok", "client_error"):
        proxy.metrics.fallbacks.labels(reason=outcome).inc()
        logger.warning("request %s: push prefill leg to %s gave %s; D prefills alone once it sees "
                       "no progress", request_id, backend.url, outcome)


def usage_tokens(answer: dict[str, Any] | None) -> tuple[int | None, int | None]:
    """P's usage: its prompt tokens, and the prefix of them its cache served."""
    usage = answer.get("usage") if answer is not None else None
    if not isinstance(usage, dict):
        return None, None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    prompt_tokens = usage.get("prompt_tokens")
    return (prompt_tokens if isinstance(prompt_tokens, int) else None,
            cached if isinstance(cached, int) else None)

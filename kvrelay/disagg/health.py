"""What the proxy's health checks ask, and how their failures count (docs/routing.md, "Health checks").

    the check    GET /health on a connection of its own, never one a leg left in the pool: a
                 failure is the instance's, not a stale connection's
    an error     refused, disconnected without an answer, or an error status: the instance
                 leaves routing at once
    a timeout    counts against the instance only as far as it looks dead: not at all when
                 bytes arrived on its legs during the check or the interval before it (proof
                 of life), half when legs are in flight on it (busy, e.g. a long prefill), in
                 full when it is idle and silent; `health_timeouts_to_drop` counted timeouts
                 take it out

Every mark-down, by a check or by a leg that could not connect, is logged with its cause
(`DownCause`) and counted by reason (kvrelay_proxy_marked_down_total).
"""

from __future__ import annotations

from typing import NamedTuple

import httpx

from kvrelay.disagg.backends import Backend


class CheckResult(NamedTuple):
    """One health check: healthy, or why not (`reason` is a label, `error` the detail)."""

    error: str | None = None
    reason: str | None = None  # unreachable | disconnected | timeout | http_<status>

    @property
    def healthy(self) -> bool:
        return self.error is None


class DownCause(NamedTuple):
    """Why an instance was taken out of routing, as its mark-down is logged and counted."""

    reason: str  # the counter's label: unreachable | disconnected | timeout | http_<status>
    error: str
    by: str  # what failed: "health check", "prefill leg", "decode leg"
    reused: bool  # whether that failure was on a reused keep-alive connection
    failed_checks: int  # health checks failed in a row so far

    def describe(self) -> str:
        connection = "a reused" if self.reused else "a fresh"
        return (f"{self.by} failed on {connection} connection ({self.error}); "
                f"{self.failed_checks} health check(s) failed in a row")


def failure_reason(error: httpx.TransportError) -> str:
    """The label of a request's transport failure."""
    if isinstance(error, httpx.TimeoutException):
        return "timeout"
    if isinstance(error, httpx.ConnectError):
        return "unreachable"
    return "disconnected"


async def check_health(client: httpx.AsyncClient, url: str, timeout: float,
                       headers: dict[str, str]) -> CheckResult:
    """GET `url`/health with `client` (the proxy's client for checks: a new connection each)."""
    try:
        response = await client.get(url + "/health", timeout=timeout, headers=headers)
    except httpx.TimeoutException:
        return CheckResult("timeout", "timeout")
    except httpx.TransportError as e:
        reason = failure_reason(e)
        return CheckResult(f"{reason}: {e!r}", reason)
    if response.status_code != 200:
        return CheckResult(f"HTTP {response.status_code}", f"http_{response.status_code}")
    return CheckResult()


def timeout_weight(backend: Backend, check_started: float, interval: float) -> float:
    """How much a check of `backend` that started at `check_started` (time.monotonic()) and
    timed out counts toward taking it out: 0 when its legs brought bytes during the check or the
    `interval` before it, 0.5 when legs are in flight on it, else 1."""
    if backend.last_bytes_at >= check_started - interval:
        return 0.0
    return 0.5 if backend.in_flight > 0 else 1.0

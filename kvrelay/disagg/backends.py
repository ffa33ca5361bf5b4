"""The proxy's pools of prefill and decode instances: who is in, who gets the next leg.

An instance's life in a pool:

    active ──(a health check fails)──> down ──(it answers again)──> active
      │                                  │
      └────────(drain)──> draining <─────┘   no new legs; removed once nothing is in flight on
                                             it and no decode leg still reads its KV

Which active instance gets a leg is the pool's routing policy (kvrelay.disagg.routing). The pool
counts, per instance, the legs in flight from this proxy, the prompt tokens they are predicted
to compute there, and (prefill) the decode legs reading the KV it computed.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvrelay.disagg.instance_info import ModelCard
from kvrelay.disagg.routing.kv_index import rank_key
from kvrelay.disagg.routing.policies import Decision, LeastLoaded, RoutingPolicy
from kvrelay.disagg.routing.prompt import PromptBlocks
from kvrelay.kv_events.subscriber import StreamAddress

ROLES = ("prefill", "decode")


class InstanceState(enum.Enum):
    ACTIVE = "active"
    DOWN = "down"  # failed its health check: no legs until it answers again
    DRAINING = "draining"  # leaving: no new legs; removed once idle


class NoInstanceError(RuntimeError):
    """The pool has no active instance for a leg."""


@dataclass(eq=False)
class Backend:
    """One `kvrelay serve` (or vLLM) instance, as the proxy sees it."""

    url: str  # base URL without a trailing slash, e.g. "http://127.0.0.1:8100"
    role: str = "decode"
    state: InstanceState = InstanceState.ACTIVE
    in_flight: int = 0  # legs from this proxy in flight on it
    queued_tokens: int = 0  # prompt tokens those legs are predicted to compute
    readers: int = 0  # decode legs reading KV this (prefill) instance computed
    health_failures: int = 0  # consecutive failed health checks
    missed_checks: float = 0.0  # timed-out checks counted against it (kvrelay.disagg.health)
    last_bytes_at: float = float("-inf")  # time.monotonic() when its legs last brought bytes
    kv_address: tuple[str, int] | None = None  # push mode: its KV side channel
    events: StreamAddress | None = None  # where it publishes KV events, when known (rank 0's)
    # Where its other data-parallel ranks publish, by rank (empty: one rank, or not known).
    rank_events: dict[int, StreamAddress] = field(default_factory=dict)
    engine: str | None = None  # "kvrelay", "vllm" or "unknown", once asked (routing/instances.py)
    info: ModelCard | None = None  # what its GET /v1/models said at join (instance_info.py); None: not yet

    @property
    def index_keys(self) -> tuple[str, ...]:
        """Its entries in the KV index: one per data-parallel rank (its URL alone without)."""
        return (self.url, *(rank_key(self.url, rank) for rank in sorted(self.rank_events)))

    @property
    def idle(self) -> bool:
        return self.in_flight == 0 and self.readers == 0


def check_url(role: str, url: str) -> str:
    """The URL without a trailing slash; ValueError naming the problem otherwise."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{role} backend URL must start with http:// or https://, got {url!r}")
    if url.rstrip("/").count("/") != 2:
        raise ValueError(f"{role} backend URL must be scheme://host:port without a path, got {url!r}")
    return url.rstrip("/")


class BackendPool:
    """The prefill or the decode instances, and the policy that picks among the active ones."""

    def __init__(self, name: str, urls: Sequence[str], policy: RoutingPolicy | None = None,
                 allow_empty: bool = False) -> None:
        if not urls and not allow_empty:
            raise ValueError(f"the {name} pool needs at least one backend URL")
        self.name = name
        self.policy = policy or LeastLoaded()
        self._members: dict[str, Backend] = {}
        for url in urls:
            self.add(url)

    @property
    def backends(self) -> list[Backend]:
        """Every member, whatever its state, in the order they joined."""
        return list(self._members.values())

    def candidates(self) -> list[Backend]:
        return [b for b in self._members.values() if b.state is InstanceState.ACTIVE]

    def get(self, url: str) -> Backend | None:
        return self._members.get(url.rstrip("/"))

    # ------------------------------------------------------------------ membership

    def add(self, url: str, kv_address: tuple[str, int] | None = None,
            events: StreamAddress | None = None) -> Backend:
        url = check_url(self.name, url)
        if url in self._members:
            raise KeyError(f"{url} is already in the {self.name} pool")
        backend = Backend(url, self.name, kv_address=kv_address, events=events)
        self._members[url] = backend
        return backend

    def drain(self, url: str) -> Backend:
        """Take an instance out of routing; it leaves once idle (see `remove_idle_drained`)."""
        backend = self._members.get(url.rstrip("/"))
        if backend is None:
            raise KeyError(f"{url} is not in the {self.name} pool")
        if backend.state is InstanceState.DRAINING:
            raise ValueError(f"{url} is already draining")
        backend.state = InstanceState.DRAINING
        return backend

    def remove_idle_drained(self) -> list[Backend]:
        """Drop the draining instances with nothing left in flight; returns them."""
        gone = [b for b in self._members.values() if b.state is InstanceState.DRAINING and b.idle]
        for backend in gone:
            del self._members[backend.url]
        return gone

    # ------------------------------------------------------------------ legs

    def choose(self, prompt: PromptBlocks | None = None) -> Decision:
        """The policy's pick among the active instances (NoInstanceError if there is none)."""
        candidates = self.candidates()
        if not candidates:
            raise NoInstanceError(f"no active {self.name} instance (of {len(self._members)} in the pool)")
        return self.policy.choose(candidates, prompt if prompt is not None else PromptBlocks(None))

    def pick(self) -> Backend:
        return self.choose().backend

    def start_leg(self, decision: Decision) -> Backend:
        """Count a leg in flight on the decision's instance; pair with `end_leg`."""
        backend = decision.backend
        backend.in_flight += 1
        backend.queued_tokens += decision.compute_tokens
        return backend

    def end_leg(self, decision: Decision) -> None:
        decision.backend.in_flight -= 1
        decision.backend.queued_tokens -= decision.compute_tokens

    def acquire(self) -> Backend:
        """Pick a backend and count one leg in flight on it; pair with `release`."""
        backend = self.pick()
        backend.in_flight += 1
        return backend

    def release(self, backend: Backend) -> None:
        backend.in_flight -= 1

    @contextmanager
    def lease(self, prompt: PromptBlocks | None = None) -> Iterator[Decision]:
        """A leg for the duration of a with-block."""
        decision = self.choose(prompt)
        self.start_leg(decision)
        try:
            yield decision
        finally:
            self.end_leg(decision)

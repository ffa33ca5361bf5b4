"""Routing policies: which instance of a pool gets the next leg.

    round-robin   each active instance in turn
    least-loaded  the fewest legs in flight from this proxy; round-robin among equals
    kv-aware      prefill: the least predicted cost, i.e. the tokens still to compute of the
                  legs already sent to the instance, plus twice the prompt tokens it would
                  compute (its cached prefix, from the KV index, not counted); decode: the fewest legs in
                  flight, and among equals the longest cached prefix (D computes one token,
                  so its cache saves transfer, not compute), or, without P/D (a proxy with no
                  prefill instance: D computes the prompt), the prefill cost. An instance whose index is
                  unusable counts as caching nothing; with no usable index at all the choice is
                  the least-loaded one.

Every decision carries a reason, counted in /metrics:
    round_robin, least_loaded                the policies without a KV view
    prefix_hit                               kv-aware chose the instance with the longest hit
    load_over_prefix_hit                     a longer hit elsewhere, outweighed by its load
    no_prefix_hit                            no instance holds any of the prompt's blocks
    index_unavailable                        no instance has a usable index: load only
    prompt_not_hashable                      the proxy cannot know the prompt's tokens
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kvrelay.disagg.routing.kv_index import KVIndex
from kvrelay.disagg.routing.prompt import PromptBlocks


class Candidate(Protocol):
    """What a policy reads of an instance (kvrelay.disagg.backends.Backend)."""

    @property
    def url(self) -> str: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def queued_tokens(self) -> int: ...

    @property
    def index_keys(self) -> tuple[str, ...]:
        """Its entries in the KV index: one per data-parallel rank, each with its own cache."""


Backend = TypeVar("Backend", bound=Candidate)  # the pool's kind of instance

POLICIES = ("kv-aware", "least-loaded", "round-robin")
DEFAULT_POLICY = "kv-aware"  # it won benchmarks/bench_routing.py (docs/benchmarks/routing.md)


@dataclass(frozen=True)
class Decision(Generic[Backend]):
    backend: Backend
    reason: str
    predicted_hit_tokens: int | None = None  # None: not predicted (no usable index)
    compute_tokens: int = 0  # prompt tokens the instance is predicted to compute for this leg


class RoutingPolicy(ABC):
    name: str

    @abstractmethod
    def choose(self, candidates: Sequence[Backend], prompt: PromptBlocks) -> Decision[Backend]:
        """Pick one of `candidates` (non-empty, in pool order) for a leg of `prompt`."""


class RoundRobin(RoutingPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: Sequence[Backend], prompt: PromptBlocks) -> Decision[Backend]:
        backend = candidates[next(self._turn) % len(candidates)]
        return Decision(backend, "round_robin", compute_tokens=prompt.num_tokens)


class LeastLoaded(RoutingPolicy):
    name = "least-loaded"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def rotated(self, candidates: Sequence[Backend]) -> list[Backend]:
        start = next(self._turn) % len(candidates)
        return list(candidates[start:]) + list(candidates[:start])

    def choose(self, candidates: Sequence[Backend], prompt: PromptBlocks) -> Decision[Backend]:
        # NOTE: min() keeps the first of equals, and the rotation makes "first" take turns.
        backend = min(self.rotated(candidates), key=lambda b: b.in_flight)
        return Decision(backend, "least_loaded", compute_tokens=prompt.num_tokens)


class KVAware(RoutingPolicy):
    name = "kv-aware"

    def __init__(self, index: KVIndex, role: str, computes_prompt: bool | None = None) -> None:
        self.index = index
        self.role = role
        # Whether the chosen instance computes the prompt (prefill, or a decode leg without P/D).
        self.computes_prompt = role == "prefill" if computes_prompt is None else computes_prompt
        self._least_loaded = LeastLoaded()

    def choose(self, candidates: Sequence[Backend], prompt: PromptBlocks) -> Decision[Backend]:
        if not prompt.hashable:
            return self._by_load(candidates, prompt, "prompt_not_hashable")
        hits = {b.url: self._prefix_hit(b, prompt) for b in candidates}
        if all(hit is None for hit in hits.values()):
            return self._by_load(candidates, prompt, "index_unavailable")
        rotated = self._least_loaded.rotated(candidates)  # equals take turns
        known = {url: hit or 0 for url, hit in hits.items()}
        if self.computes_prompt:
            # NOTE: the cost of a leg on an instance is the wait for the legs queued there plus
            # its own compute twice: once for its own first token, once more for the legs that
            # will queue behind it. Weighing the queue alone against one compute sends a prompt
            # away from its cached prefix whenever that instance is busy, and the prefix is then
            # computed again: more work for the whole pool, and longer queues for everyone.
            backend = min(rotated, key=lambda b: b.queued_tokens + 2 * (prompt.num_tokens - known[b.url]))
        else:
            backend = min(rotated, key=lambda b: (b.in_flight, -known[b.url]))
        best = max(known.values())
        reason = ("no_prefix_hit" if best == 0 else "prefix_hit" if known[backend.url] == best
                  else "load_over_prefix_hit")
        return Decision(backend, reason, hits[backend.url],
                        compute_tokens=prompt.num_tokens - known[backend.url])

    def _prefix_hit(self, candidate: Candidate, prompt: PromptBlocks) -> int | None:
        """The longest hit of any one of the candidate's ranks (a prefix split across two ranks'
        caches saves nothing); None when no rank's index is usable."""
        hits = [hit for key in candidate.index_keys
                if (hit := self.index.prefix_hit_tokens(key, prompt)) is not None]
        return max(hits) if hits else None

    def _by_load(self, candidates: Sequence[Backend], prompt: PromptBlocks, reason: str) -> Decision[Backend]:
        choice = self._least_loaded.choose(candidates, prompt)
        return Decision(choice.backend, reason, compute_tokens=prompt.num_tokens)


def create_policy(name: str, role: str, index: KVIndex | None,
                  computes_prompt: bool | None = None) -> RoutingPolicy:
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "kv-aware":
        if index is None:
            raise ValueError("the kv-aware policy needs a KV index")
        return KVAware(index, role, computes_prompt)
    raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {name!r}")

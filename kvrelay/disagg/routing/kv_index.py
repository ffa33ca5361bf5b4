"""The proxy's KV index: per instance, the block hashes it holds, fed by its KV events.

An instance that runs several data-parallel ranks has one entry per rank, each fed by that
rank's own event stream: the index keys on (instance, rank), as `rank_key` spells it, and rank
0's key (every instance without data parallelism) is the instance's URL.

Each instance's entry holds its blocks by medium ("GPU" for its own KV cache, "CPU", "DISK",
... for offload tiers), the block size its events declare, and an overlay of *expected* blocks:
the prompt blocks of prefill legs the proxy sent there and whose stores have not been published
yet, so a burst of requests sharing a prefix follows the first one before its events arrive.

What the index says of an instance is a prediction, and it errs only toward "not cached":
a reset of the stream (a restart, a reconnect, batches lost for good) clears the instance's
entry and it fills again from the events that follow. An instance whose index cannot be
trusted is *unusable*: no events endpoint, no subscription yet, or published stores that did
not arrive within `stale_after_s` of a prefill leg that must have made some. The routing
policy then weighs it by load alone, and /metrics says so.

Each entry also says how its instance hashes blocks (routing/hash_schemes.py): kvrelay's hash,
or vLLM's with one algorithm and seed among candidates. The instance's own BlockStored events
check it: the first one that can tell confirms the scheme or picks the candidate that
reproduces it; when none does, the instance's hashes are *not reproducible* and its index is
unusable (routed by load) until it starts over. Predictions are made in the form the instance
publishes (digests, or vLLM's 64-bit integers).

Thread-safety: the subscriber thread writes, the proxy's event loop reads; one lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvrelay.disagg.routing.hash_schemes import KVRELAY_SCHEME, BlockHashScheme, check_stored, external
from kvrelay.disagg.routing.prompt import PromptBlocks
from kvrelay.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventBatch,
)

logger = logging.getLogger(__name__)

HASHES_ASSUMED, HASHES_VERIFIED, HASHES_NOT_REPRODUCIBLE = "assumed", "verified", "not reproducible"


def rank_key(url: str, dp_rank: int) -> str:
    """The index's key for data-parallel rank `dp_rank` of the instance at `url`."""
    return url if dp_rank == 0 else f"{url}#dp{dp_rank}"


@dataclass
class InstanceIndex:
    subscribed: bool = False  # an events stream is followed for this instance
    block_size: int | None = None
    schemes: tuple[BlockHashScheme, ...] = (KVRELAY_SCHEME,)  # candidates, the one in use first
    hashes: str = HASHES_ASSUMED  # whether its events confirmed schemes[0]
    int_hashes: bool = False  # it publishes hashes as integers (vLLM's default)
    media: dict[str, set[ExternalBlockHash]] = field(default_factory=dict)
    expected: Counter[ExternalBlockHash] = field(default_factory=Counter)  # blocks of legs in flight
    expected_by_request: dict[str, list[ExternalBlockHash]] = field(default_factory=dict)
    expiries: dict[str, float] = field(default_factory=dict)  # request id -> monotonic deadline
    awaiting_since: float | None = None  # a leg finished that must have stored blocks; none seen
    last_batch_at: float | None = None  # time.monotonic() of the newest batch
    num_resets: int = 0
    last_reset_reason: str | None = None

    @property
    def scheme(self) -> BlockHashScheme:
        return self.schemes[0]

    def prompt_hashes(self, prompt: PromptBlocks, block_size: int) -> list[ExternalBlockHash]:
        return [external(h, self.int_hashes) for h in prompt.block_hashes(block_size, self.scheme)]

    def holds(self, block_hash: ExternalBlockHash) -> bool:
        return self.expected[block_hash] > 0 or any(block_hash in held for held in self.media.values())

    def num_blocks(self) -> dict[str, int]:
        return {medium: len(held) for medium, held in self.media.items()}


@dataclass(frozen=True)
class IndexStatus:
    usable: bool
    reason: str  # "ok", "no events endpoint", "no events yet", "stale: ...", "hashes not
    # reproducible: ...", "unknown instance"
    blocks: dict[str, int]
    resets: int
    scheme: str = KVRELAY_SCHEME.name  # how the proxy hashes the instance's blocks
    hashes: str = HASHES_ASSUMED  # assumed | verified (by its events) | not reproducible


class KVIndex:
    def __init__(self, stale_after_s: float = 5.0, expected_grace_s: float = 2.0) -> None:
        self.stale_after_s = stale_after_s
        self.expected_grace_s = expected_grace_s  # a settled leg's expected blocks stay this long
        self._instances: dict[str, InstanceIndex] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ membership

    def track(self, url: str, subscribed: bool, block_size: int | None = None,
              schemes: Sequence[BlockHashScheme] = (KVRELAY_SCHEME,)) -> None:
        """Start an empty entry for `url` (replacing any); `subscribed`: events will come;
        `schemes`: how it may hash blocks, the likeliest first (its events will tell)."""
        if not schemes:
            raise ValueError(f"{url}: no block hash scheme the proxy can compute for it")
        with self._lock:
            self._instances[url] = InstanceIndex(subscribed=subscribed, block_size=block_size,
                                                 schemes=tuple(schemes))

    def forget(self, url: str) -> None:
        with self._lock:
            self._instances.pop(url, None)

    # ------------------------------------------------------------------ the events (EventSink)

    def on_batch(self, source: str, seq: int, batch: KVEventBatch) -> None:
        with self._lock:
            entry = self._instances.get(source)
            if entry is None:
                return
            entry.awaiting_since = None
            entry.last_batch_at = time.monotonic()
            for event in batch.events:
                if isinstance(event, BlockStored):
                    entry.block_size = event.block_size
                    entry.int_hashes = bool(event.block_hashes) and isinstance(event.block_hashes[0], int)
                    if entry.hashes != HASHES_VERIFIED:
                        self._check_hashes(source, entry, event)
                    entry.media.setdefault(_medium(event.medium), set()).update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    entry.media.get(_medium(event.medium), set()).difference_update(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    entry.media.clear()

    def _check_hashes(self, source: str, entry: InstanceIndex, event: BlockStored) -> None:
        """Confirm the entry's scheme with `event`, or switch to the candidate that reproduces
        it, or mark the instance's hashes as not reproducible."""
        verdicts = [(scheme, check_stored(scheme, event)) for scheme in entry.schemes]
        if all(verdict is None for _, verdict in verdicts):
            return  # this event cannot tell (extra keys, an integer parent, ...)
        match = next((scheme for scheme, verdict in verdicts if verdict), None)
        if match is None:
            if entry.hashes != HASHES_NOT_REPRODUCIBLE:
                logger.warning("%s: its block hashes match none of the schemes the proxy computes (%s); "
                               "kv-aware routing weighs it by load alone. A vLLM instance with "
                               "PYTHONHASHSEED set needs the same value as the proxy's --pythonhashseed; "
                               "xxhash without PYTHONHASHSEED is random per process", source,
                               ", ".join(s.key for s in entry.schemes))
            entry.hashes = HASHES_NOT_REPRODUCIBLE
            return
        if match is not entry.scheme:
            logger.info("%s hashes blocks as %s", source, match.key)
        entry.schemes = (match, *(s for s in entry.schemes if s is not match))
        entry.hashes = HASHES_VERIFIED

    def on_reset(self, source: str, reason: str) -> None:
        with self._lock:
            entry = self._instances.get(source)
            if entry is not None:
                entry.media.clear()
                entry.num_resets += 1
                entry.last_reset_reason = reason
                if entry.hashes == HASHES_VERIFIED:
                    entry.hashes = HASHES_ASSUMED  # a new process may hash otherwise: check again

    # ------------------------------------------------------------------ routing's questions

    def status(self, url: str, now: float | None = None) -> IndexStatus:
        with self._lock:
            entry = self._instances.get(url)
            if entry is None:
                return IndexStatus(False, "unknown instance", {}, 0)
            return IndexStatus(*self._usable(entry, now), entry.num_blocks(), entry.num_resets,
                               entry.scheme.name, entry.hashes)

    def _usable(self, entry: InstanceIndex, now: float | None) -> tuple[bool, str]:
        if not entry.subscribed:
            return False, "no events endpoint"
        if entry.hashes == HASHES_NOT_REPRODUCIBLE:
            return False, "hashes not reproducible: its events match no scheme the proxy computes"
        if entry.block_size is None:
            return False, "no events yet"
        if entry.awaiting_since is not None:
            waited = (now if now is not None else time.monotonic()) - entry.awaiting_since
            if waited > self.stale_after_s:
                return False, f"stale: no events {waited:.0f} s after a prefill that stores blocks"
        return True, "ok"

    def prefix_hit_tokens(self, url: str, prompt: PromptBlocks) -> int | None:
        """Prompt tokens of the longest run of leading full blocks `url` holds (or is expected
        to hold), capped as an engine caps a hit; None when its index is unusable."""
        with self._lock:
            entry = self._instances.get(url)
            if entry is None or not self._usable(entry, None)[0] or entry.block_size is None:
                return None
            self._expire(entry)
            block_size = entry.block_size
            hashes = entry.prompt_hashes(prompt, block_size)[:prompt.max_hit_blocks(block_size)]
            num_hit = 0
            for block_hash in hashes:
                if not entry.holds(block_hash):
                    break
                num_hit += 1
            return num_hit * block_size

    def whole_blocks(self, url: str, num_tokens: int) -> int:
        """`num_tokens` cut to the instance's full blocks, the unit a predicted hit counts in
        (an offload tier may serve a partial last block); unchanged if its block size is unknown."""
        with self._lock:
            entry = self._instances.get(url)
            block_size = entry.block_size if entry is not None else None
        return num_tokens - num_tokens % block_size if block_size else num_tokens

    def expect(self, url: str, request_id: str, prompt: PromptBlocks) -> None:
        """A prefill leg of `prompt` goes to `url`: count its blocks as held there until the
        leg is settled (its stores should be published by then)."""
        with self._lock:
            entry = self._instances.get(url)
            if entry is None or entry.block_size is None or not prompt.hashable:
                return
            hashes = entry.prompt_hashes(prompt, entry.block_size)
            entry.expected.update(hashes)
            entry.expected_by_request[request_id] = hashes

    def settle(self, url: str, request_id: str, started_at: float, prompt_tokens: int | None,
               cached_tokens: int | None) -> None:
        """The prefill leg that started at `started_at` (time.monotonic()) ended; P's usage says
        how many of its `prompt_tokens` were cached. If it computed full blocks, their stores
        must be published: if no batch has come since the leg started and none comes within
        stale_after_s, the index is stale. The leg's expected blocks go after a grace period."""
        with self._lock:
            entry = self._instances.get(url)
            if entry is None:
                return
            now = time.monotonic()
            if request_id in entry.expected_by_request:
                entry.expiries[request_id] = now + self.expected_grace_s
            bs = entry.block_size
            if prompt_tokens is None or cached_tokens is None or bs is None or not entry.subscribed:
                return
            stored_blocks = (prompt_tokens // bs) * bs > cached_tokens
            heard_since = entry.last_batch_at is not None and entry.last_batch_at >= started_at
            if stored_blocks and not heard_since and entry.awaiting_since is None:
                entry.awaiting_since = now

    def _expire(self, entry: InstanceIndex) -> None:
        now = time.monotonic()
        for request_id, deadline in list(entry.expiries.items()):
            if deadline > now:
                continue
            del entry.expiries[request_id]
            for block_hash in entry.expected_by_request.pop(request_id, []):
                entry.expected[block_hash] -= 1
                if entry.expected[block_hash] <= 0:
                    del entry.expected[block_hash]


def _medium(medium: str | None) -> str:
    return (medium or "GPU").upper()

"""TieredStore: the tiers top-down behind one object that speaks in verified chunks.

Lookups ask every tier for what the tiers above lack, in one batched call per tier. Reads go
top-down; a blob that fails verification is removed from its tier and the next tier is tried;
a hit in a lower tier is copied up into every tier above it (promotion). Writes go through to
every tier, so the disk survives a restart and Redis shares with other instances.

Entries are full chunks or a prompt's tail (its tokens past the last full chunk), a smaller
blob under its own key; the reader says which it expects (`Expected`), and a blob that holds
the other kind is corrupt. Tiers account every blob by its size, so tails and chunks share one
LRU budget (Redis: its own eviction and the TTL).

A tier that fails (TierError) is a miss for that call, counted and logged once (then at most
every minute); a failing remote tier is skipped for `retry_seconds` so a dead server costs one
timeout, not one per request.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from kvrelay.kv_transfer.offload.codec import ChunkError, decode_chunk
from kvrelay.kv_transfer.offload.stats import OffloadStats
from kvrelay.kv_transfer.offload.tiers import build_tiers
from kvrelay.kv_transfer.offload.tiers.base import Blob, StorageTier, TierError

if TYPE_CHECKING:
    from kvrelay.kv_transfer.offload.config import OffloadConfig

logger = logging.getLogger(__name__)

_LOG_EVERY_SECONDS = 60.0


class Expected(NamedTuple):
    """What a reader expects a key's blob to hold: a full chunk (tail_tokens 0) or a prompt's
    tail of `tail_tokens` tokens, with `payload_bytes` of KV after the header."""

    payload_bytes: int
    tail_tokens: int = 0


def private_copy(blob: Blob) -> memoryview:
    """A copy of `blob` that the caller's later writes to it cannot touch.

    NOTE: numpy copies with the GIL released. `bytes(blob)` holds it through the whole memcpy:
    measured, a 12 MB copy on the writer thread stalled a Python thread that wanted the GIL by up
    to 7 ms (0.8 ms with numpy). On the engine, that thread is the one driving the model."""
    return np.frombuffer(blob, dtype=np.uint8).copy().data


def shard_key(key: str, shard: str) -> str:
    """The key a tier holds one tensor-parallel shard of chunk `key` under."""
    return hashlib.sha256(f"{key}/{shard}".encode()).hexdigest()[:len(key)] if shard else key


class TieredStore:
    def __init__(self, tiers: Sequence[StorageTier], fingerprint: str, payload_bytes: int,
                 stats: OffloadStats, retry_seconds: float = 5.0, shard: str = "") -> None:
        """`shard`: this store holds one tensor-parallel rank's part of each chunk (e.g.
        "tp2-rank1"); its blobs live under keys derived from the chunk key and the shard, so the
        ranks of one instance (and instances of other TP sizes) share tiers without mixing."""
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        self.tiers = list(tiers)
        self.fingerprint = fingerprint
        self.payload_bytes = payload_bytes
        self.stats = stats
        self.retry_seconds = retry_seconds
        self._down_until: dict[str, float] = {}
        self._last_log: dict[str, float] = {}
        self.shard = shard
        # KV events of the local tiers: (tier, "stored" | "removed", tier key); None until asked.
        self._events: list[tuple[str, str, str]] | None = None
        self._events_lock = threading.Lock()
        for tier in self.tiers:
            if not tier.remote:
                tier.on_evict = functools.partial(self._note, tier.name, "removed")

    def _tier_keys(self, keys: Sequence[str]) -> list[str]:
        """Chunk keys -> the keys the tiers hold them under (the same keys without a shard)."""
        return [shard_key(key, self.shard) for key in keys]

    # ------------------------------------------------------------------ queries
    def lookup(self, keys: Sequence[str]) -> int:
        """How many leading `keys` some tier holds (contains checks only, batched per tier)."""
        present = [False] * len(keys)
        for tier in self.tiers:
            missing = [i for i, found in enumerate(present) if not found]
            if not missing:
                break
            answer = self._guarded(tier, "contains", self._tier_keys([keys[i] for i in missing]))
            for i, found in zip(missing, answer or [], strict=False):
                present[i] = found
        num_leading = next((i for i, found in enumerate(present) if not found), len(keys))
        self.stats.add_many({"offload_lookups": 1, "offload_lookup_chunks": len(keys),
                             "offload_lookup_hit_chunks": num_leading})
        return num_leading

    def get_many(self, keys: Sequence[str],
                 expected: Sequence[Expected] | None = None) -> list[memoryview | None]:
        """Each key's verified payload, or None; hits below the top tier are promoted.
        `expected[i]` says what keys[i] holds; by default, every key is a full chunk."""
        full = Expected(self.payload_bytes)
        shapes = list(expected) if expected is not None else [full] * len(keys)
        if len(shapes) != len(keys):
            raise ValueError(f"get_many: {len(keys)} keys but {len(shapes)} expected shapes")
        payloads: list[memoryview | None] = [None] * len(keys)
        for level, tier in enumerate(self.tiers):
            missing = [i for i, p in enumerate(payloads) if p is None]
            if not missing:
                break
            blobs = self._guarded(tier, "get", self._tier_keys([keys[i] for i in missing]))
            if blobs is None:
                continue
            corrupt: list[str] = []
            promote: list[tuple[str, Blob]] = []
            for i, blob in zip(missing, blobs, strict=True):
                payload = self._verify(tier, keys[i], shapes[i], blob, corrupt)
                if payload is not None:
                    payloads[i] = payload
                    promote.append((keys[i], blob))  # type: ignore[arg-type]
            hits = len(promote)
            self.stats.add_many({f"offload_{tier.name}_hits": hits,
                                 f"offload_{tier.name}_misses": len(missing) - hits})
            if corrupt:
                self._guarded(tier, "remove", self._tier_keys(corrupt))
                self._note(tier.name, "removed", self._tier_keys(corrupt))
            if promote and level > 0:
                self._promote(self.tiers[:level], promote)
        return payloads

    def _verify(self, tier: StorageTier, key: str, shape: Expected, blob: Blob | None,
                corrupt: list[str]) -> memoryview | None:
        if blob is None:
            return None
        try:
            return decode_chunk(blob, key, self.fingerprint, shape.payload_bytes, shape.tail_tokens)
        except ChunkError as e:
            self.stats.add(f"offload_{tier.name}_corrupt")
            self.log_rate_limited(f"{tier.name}-corrupt", "offload %s tier: %s; dropped, recomputing",
                                  tier.name, e)
            corrupt.append(key)
            return None

    def _promote(self, upper: list[StorageTier], items: list[tuple[str, Blob]]) -> None:
        tier_keys = self._tier_keys([key for key, _ in items])
        items = [(tier_key, blob) for tier_key, (_, blob) in zip(tier_keys, items, strict=True)]
        for tier in upper:
            if self._guarded(tier, "put", items) is not None:
                self.stats.add("offload_promotions", len(items))
                self._note(tier.name, "stored", [tier_key for tier_key, _ in items])

    # ------------------------------------------------------------------ writes
    def put(self, key: str, blob: Blob, reused: bool = False) -> bool:
        """Write through to every tier; True when at least one tier stored the chunk.
        `reused`: the caller reuses `blob` afterwards, so a tier that keeps blobs gets a copy."""
        stored = False
        tier_key = shard_key(key, self.shard)
        for tier in self.tiers:
            kept = private_copy(blob) if reused and tier.keeps_blobs else blob
            if self._guarded(tier, "put", [(tier_key, kept)]) is not None:
                stored = True
                if self._events is not None and not tier.remote and tier.contains([tier_key])[0]:
                    self._note(tier.name, "stored", [tier_key])
        return stored

    def remove(self, keys: Sequence[str]) -> None:
        for tier in self.tiers:
            self._guarded(tier, "remove", self._tier_keys(keys))
            self._note(tier.name, "removed", self._tier_keys(keys))

    def take_events(self) -> list[tuple[str, str, str]]:
        """The local tiers' changes since the last call: (tier name, "stored" | "removed", tier
        key), in order. Recording starts with the first call: nobody asking, nothing is kept."""
        with self._events_lock:
            events, self._events = self._events or [], []
        return events

    def _note(self, tier_name: str, kind: str, tier_keys: Sequence[str]) -> None:
        if self._events is None or any(t.name == tier_name and t.remote for t in self.tiers):
            return
        with self._events_lock:
            if self._events is not None:
                self._events.extend((tier_name, kind, tier_key) for tier_key in tier_keys)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    # ------------------------------------------------------------------ failures
    def _guarded(self, tier: StorageTier, what: str, arg: Sequence[Any]) -> Any:
        """`tier.<what>(arg)`; None (a miss) when the tier fails or is skipped after a failure.
        Calls returning nothing return True on success."""
        if time.monotonic() < self._down_until.get(tier.name, 0.0):
            return None
        try:
            result = getattr(tier, what)(arg)
        except TierError as e:
            self.stats.add(f"offload_{tier.name}_errors")
            if tier.remote:
                self._down_until[tier.name] = time.monotonic() + self.retry_seconds
            self.log_rate_limited(tier.name, "offload %s tier %s failed (%s); serving without it",
                                  tier.name, what, e)
            return None
        return True if result is None else result

    def log_rate_limited(self, topic: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last_log.get(topic, -_LOG_EVERY_SECONDS) >= _LOG_EVERY_SECONDS:
            self._last_log[topic] = now
            logger.warning(message, *args)


def build_store(config: OffloadConfig, fingerprint: str, payload_bytes: int,
                stats: OffloadStats, shard: str = "") -> TieredStore:
    """The tiers `config` names, fastest first, inside one TieredStore."""
    return TieredStore(build_tiers(config, stats), fingerprint, payload_bytes, stats,
                       retry_seconds=config.retry_seconds, shard=shard)

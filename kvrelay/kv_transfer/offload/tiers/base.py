"""The storage tier interface: a byte store keyed by chunk key, batched, thread-safe.

A tier knows nothing about KV, tensors or headers: it keeps opaque chunk blobs (see codec.py)
under string keys. Every call takes and returns lists, so a remote tier can answer a whole
prefix in one round trip. A tier that cannot answer (connection refused, timeout, full disk)
raises TierError; the TieredStore above it turns that into a miss and keeps serving.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from kvrelay.kv_transfer.offload.stats import OffloadStats

# A stored chunk as a tier holds it: anything exposing its bytes through the buffer protocol.
Blob = bytes | bytearray | memoryview


class TierError(Exception):
    """The tier failed to answer (not a miss): the caller treats the call as a miss."""


class StorageTier(ABC):
    """One level of the offload hierarchy (cpu, disk, redis), top-down in that order.

    `name` becomes part of the stat keys (`offload_{name}_hits`, ...). Implementations must be
    safe to call from several threads (the writer, the loader and the lookup server).
    """

    name: str = "tier"
    remote: bool = False  # a failing remote tier is skipped for a while (see TieredStore)
    keeps_blobs: bool = False  # put() keeps a reference to the blob (instead of copying it out)

    def __init__(self, stats: OffloadStats) -> None:
        self.stats = stats
        # Told the keys a tier drops on its own (LRU eviction), for the KV events (store.py).
        self.on_evict: Callable[[Sequence[str]], None] | None = None

    def _evicted(self, keys: Sequence[str]) -> None:
        if keys and self.on_evict is not None:
            self.on_evict(keys)

    @abstractmethod
    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored. Side-effect free: recency is not updated."""

    @abstractmethod
    def get(self, keys: Sequence[str]) -> list[Blob | None]:
        """Each key's blob, or None where it is missing. A hit counts as a use (LRU)."""

    @abstractmethod
    def put(self, items: Sequence[tuple[str, Blob]]) -> None:
        """Store blobs, replacing any under the same key; may evict to stay within budget."""

    @abstractmethod
    def remove(self, keys: Sequence[str]) -> None:
        """Forget keys (missing keys are ignored)."""

    def close(self) -> None:
        """Release connections and files. The tier is not used afterwards."""
        return None

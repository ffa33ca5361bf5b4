"""The host-memory tier: blobs in a dict, least recently used evicted past `cpu_bytes`."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvrelay.kv_transfer.offload.stats import OffloadStats
from kvrelay.kv_transfer.offload.tiers.base import Blob, StorageTier
from kvrelay.kv_transfer.offload.tiers.lru import LRUByteIndex


class CpuTier(StorageTier):
    name = "cpu"
    keeps_blobs = True

    def __init__(self, capacity_bytes: int, stats: OffloadStats) -> None:
        super().__init__(stats)
        self._lru = LRUByteIndex(capacity_bytes)
        self._blobs: dict[str, Blob] = {}
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._lru.used_bytes

    def keys(self) -> list[str]:
        """Stored keys, least recently used first."""
        with self._lock:
            return self._lru.keys()

    def contains(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key in self._blobs for key in keys]

    def get(self, keys: Sequence[str]) -> list[Blob | None]:
        with self._lock:
            found = [self._blobs.get(key) for key in keys]
            for key, blob in zip(keys, found, strict=True):
                if blob is not None:
                    self._lru.touch(key)
        return found

    def put(self, items: Sequence[tuple[str, Blob]]) -> None:
        evicted, num_evicted = [], 0
        with self._lock:
            for key, blob in items:
                self._blobs[key] = blob
                for old in self._lru.add(key, len(blob)):
                    self._blobs.pop(old, None)
                    evicted.append(old)
                    num_evicted += old != key
        self._evicted(evicted)
        self.stats.add_many({"offload_cpu_bytes_written": sum(len(b) for _, b in items),
                             "offload_cpu_evictions": num_evicted})

    def remove(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._blobs.pop(key, None)
                self._lru.discard(key)

    def close(self) -> None:
        with self._lock:
            self._blobs.clear()

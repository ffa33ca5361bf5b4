"""The eviction policy shared by the byte-budgeted tiers: least recently used, by size."""

from __future__ import annotations

from collections import OrderedDict


class LRUByteIndex:
    """Keys with their sizes, oldest use first; says which keys to evict to fit a budget.

    Not thread-safe: the owning tier holds its lock around every call.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"a tier budget must be > 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys(self) -> list[str]:
        """Oldest use first."""
        return list(self._sizes)

    def touch(self, key: str) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def add(self, key: str, size: int) -> list[str]:
        """Record `key` as the most recent; returns the keys to evict (never `key` itself,
        unless it alone exceeds the budget, in which case it is returned and not kept)."""
        self.discard(key)
        if size > self.capacity_bytes:
            return [key]
        self._sizes[key] = size
        self.used_bytes += size
        evicted = []
        while self.used_bytes > self.capacity_bytes:
            old, old_size = self._sizes.popitem(last=False)
            self.used_bytes -= old_size
            evicted.append(old)
        return evicted

    def discard(self, key: str) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.used_bytes -= size

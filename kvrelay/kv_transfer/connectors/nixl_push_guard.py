"""D's write guard for a push over a transport that sees each write (TCP): which blocks a live
registration owns, which admitted writes are still landing, and who hears when one landed."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Sequence


class BlockGuard:
    """The write guard of a transport that sees writes: admits a write only into blocks one
    live registration owns, and counts admitted writes until they are done."""

    def __init__(self, on_landed: Callable[[str, Sequence[int], Sequence[int]], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._on_landed = on_landed  # (registration id, block ids, layers), on the writer's thread
        self._owner: dict[int, str] = {}  # block id -> registration id
        self._in_flight: dict[str, int] = defaultdict(int)
        self._admitted: dict[tuple[int, ...], list[str]] = defaultdict(list)

    def open(self, registration_id: str, block_ids: Sequence[int]) -> None:
        with self._lock:
            for block_id in block_ids:
                self._owner[block_id] = registration_id

    def close(self, registration_id: str) -> None:
        """Admit no more writes for the registration (those admitted still count)."""
        with self._lock:
            self._owner = {b: r for b, r in self._owner.items() if r != registration_id}

    def in_flight(self, registration_id: str) -> int:
        with self._lock:
            return self._in_flight.get(registration_id, 0)

    def admit(self, block_ids: Sequence[int], notification: bytes) -> str | None:
        if not block_ids:
            return None  # only a notification: D matches it against a live registration itself
        with self._lock:
            owners = {self._owner.get(b) for b in block_ids}
            if len(owners) != 1 or None in owners:
                return f"blocks {sorted(block_ids)[:8]} are not registered for one push here"
            (owner,) = owners
            assert owner is not None
            self._in_flight[owner] += 1
            self._admitted[tuple(block_ids)].append(owner)
            return None

    def landed(self, block_ids: Sequence[int], layers: Sequence[int]) -> None:
        if not block_ids or self._on_landed is None:
            return
        with self._lock:
            owner = self._admitted[tuple(block_ids)][-1]
        self._on_landed(owner, block_ids, layers)

    def done(self, block_ids: Sequence[int], notification: bytes) -> None:
        if not block_ids:
            return
        with self._lock:
            key = tuple(block_ids)
            owner = self._admitted[key].pop()
            if not self._admitted[key]:
                del self._admitted[key]
            self._in_flight[owner] -= 1
            if not self._in_flight[owner]:
                del self._in_flight[owner]

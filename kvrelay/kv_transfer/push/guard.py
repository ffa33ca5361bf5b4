"""D's write guard for a push over a transport that sees each write (TCP): which blocks a live
registration owns, which admitted writes are still landing, and who hears when one landed.

Between tensor-parallel instances of different sizes one of D's blocks can be written by several
of P's ranks, each its own KV heads' byte ranges under its own registration: a block is owned per
(block, ranges), and a write is admitted only under the registration that owns exactly its
blocks and byte ranges."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Sequence

RangesKey = tuple[tuple[int, int], ...] | None  # a write's (offset, length) ranges of each block; None: whole


def ranges_key(ranges: Sequence[tuple[int, int]] | None) -> RangesKey:
    return None if ranges is None else tuple((int(offset), int(length)) for offset, length in ranges)


class BlockGuard:
    """The write guard of a transport that sees writes: admits a write only into blocks one
    live registration owns, and counts admitted writes until they are done."""

    def __init__(self, on_landed: Callable[[str, Sequence[int], Sequence[int]], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._on_landed = on_landed  # (registration id, block ids, layers), on the writer's thread
        self._owner: dict[tuple[int, RangesKey], str] = {}  # (block id, ranges) -> registration id
        self._in_flight: dict[str, int] = defaultdict(int)
        self._admitted: dict[tuple[tuple[int, ...], RangesKey], list[str]] = defaultdict(list)

    def open(self, registration_id: str, block_ids: Sequence[int],
             ranges: Sequence[tuple[int, int]] | None = None) -> None:
        key = ranges_key(ranges)
        with self._lock:
            for block_id in block_ids:
                self._owner[(block_id, key)] = registration_id

    def close(self, registration_id: str) -> None:
        """Admit no more writes for the registration (those admitted still count)."""
        with self._lock:
            self._owner = {b: r for b, r in self._owner.items() if r != registration_id}

    def in_flight(self, registration_id: str) -> int:
        with self._lock:
            return self._in_flight.get(registration_id, 0)

    def admit(self, block_ids: Sequence[int], notification: bytes,
              ranges: Sequence[tuple[int, int]] | None = None) -> str | None:
        if not block_ids:
            return None  # only a notification: D matches it against a live registration itself
        key = ranges_key(ranges)
        with self._lock:
            owners = {self._owner.get((b, key)) for b in block_ids}
            if len(owners) != 1 or None in owners:
                return (f"blocks {sorted(block_ids)[:8]} (byte ranges {key}) are not registered for one "
                        "push here")
            (owner,) = owners
            assert owner is not None
            self._in_flight[owner] += 1
            self._admitted[(tuple(block_ids), key)].append(owner)
            return None

    def landed(self, block_ids: Sequence[int], layers: Sequence[int],
               ranges: Sequence[tuple[int, int]] | None = None) -> None:
        if not block_ids or self._on_landed is None:
            return
        with self._lock:
            owner = self._admitted[(tuple(block_ids), ranges_key(ranges))][-1]
        self._on_landed(owner, block_ids, layers)

    def done(self, block_ids: Sequence[int], notification: bytes,
             ranges: Sequence[tuple[int, int]] | None = None) -> None:
        if not block_ids:
            return
        with self._lock:
            key = (tuple(block_ids), ranges_key(ranges))
            owner = self._admitted[key].pop()
            if not self._admitted[key]:
                del self._admitted[key]
            self._in_flight[owner] -= 1
            if not self._in_flight[owner]:
                del self._in_flight[owner]

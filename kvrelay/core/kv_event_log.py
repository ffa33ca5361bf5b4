"""The block pool's KV events, collected between two engine steps.

The pool reports what changes in its hash map (the blocks prefix lookup can find): a block that
enters it, a block that leaves it, all of them cleared. The scheduler takes the step's events
once per step and hands them to the publisher as one batch. Without a publisher the pool gets
the null log, and recording costs one no-op call.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrelay.kv_events.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class NullKVEventLog:
    """Events off: nothing is recorded."""

    def stored(self, positions: Sequence[int], block_hashes: Sequence[bytes], parent_hash: bytes | None,
               token_ids: Sequence[int], first_token: int) -> None:
        return None

    def removed(self, block_hash: bytes) -> None:
        return None

    def cleared(self) -> None:
        return None

    def take(self) -> list[KVEvent]:
        return []


class KVEventLog(NullKVEventLog):
    def __init__(self, block_size: int, medium: str = MEDIUM_GPU) -> None:
        self.block_size = block_size
        self.medium = medium
        self._events: list[KVEvent] = []

    def stored(self, positions: Sequence[int], block_hashes: Sequence[bytes], parent_hash: bytes | None,
               token_ids: Sequence[int], first_token: int) -> None:
        """Blocks `block_hashes[i]` for i in `positions` (ascending) entered the map. The hashes
        are a chain after `parent_hash`; block i holds token_ids[first_token + i * block_size:]
        (block_size of them). One BlockStored per run of consecutive positions, each naming the
        block before it as parent, as vLLM's consumers expect of a chain."""
        bs = self.block_size
        run_start = 0
        for k in range(1, len(positions) + 1):
            if k < len(positions) and positions[k] == positions[k - 1] + 1:
                continue
            first, last = positions[run_start], positions[k - 1]
            parent = parent_hash if first == 0 else block_hashes[first - 1]
            start = first_token + first * bs
            self._events.append(BlockStored(
                block_hashes=list(block_hashes[first:last + 1]), parent_block_hash=parent,
                token_ids=list(token_ids[start:start + (last - first + 1) * bs]), block_size=bs,
                lora_id=None, medium=self.medium, lora_name=None))
            run_start = k

    def removed(self, block_hash: bytes) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):  # consecutive evictions: one event
            last.block_hashes.append(block_hash)
            return
        self._events.append(BlockRemoved(block_hashes=[block_hash], medium=self.medium))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events


NULL_KV_EVENT_LOG = NullKVEventLog()

"""A simulated instance's KV blocks: a free count plus a prefix cache of trace blocks.

The trace names prompt blocks of `chunk_tokens` tokens (Mooncake: 512) by id; a cached id stands
for the engine blocks that hold that chunk. Ids held by a running request are pinned; the others
sit in an LRU queue and are evicted when an allocation needs their blocks, as kvrelay's free
queue evicts cached blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvrelay.utils import cdiv


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, chunk_tokens: int,
                 enable_prefix_cache: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"an instance needs at least one KV block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self.chunk_blocks = cdiv(chunk_tokens, block_size)
        self.enable_prefix_cache = enable_prefix_cache
        self.num_free = num_blocks  # blocks neither held by a request nor caching a chunk
        self._holders: dict[int, int] = {}  # chunk id -> requests holding it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unheld chunk ids, LRU first

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    @property
    def blocks_in_use(self) -> int:
        """Blocks held by requests or pinned chunks (cached, unheld chunks are reclaimable)."""
        return self.num_blocks - self.num_free - len(self._evictable) * self.chunk_blocks

    def match(self, hash_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The longest run of leading chunk ids cached here, covering at most `max_tokens`."""
        if not self.enable_prefix_cache:
            return []
        hit: list[int] = []
        for h in hash_ids[: max_tokens // self.chunk_tokens]:
            if h not in self._holders:
                break
            hit.append(h)
        return hit

    def acquire(self, hash_ids: Sequence[int]) -> None:
        for h in hash_ids:
            self._holders[h] += 1
            self._evictable.pop(h, None)

    def release(self, hash_ids: Sequence[int]) -> None:
        for h in hash_ids:
            self._holders[h] -= 1
            if self._holders[h] == 0:
                self._evictable[h] = None  # most recently used last

    def allocate(self, num_blocks: int) -> bool:
        """Take `num_blocks` free blocks, evicting unheld chunks LRU first; False if impossible."""
        if num_blocks <= 0:
            return True
        while self.num_free < num_blocks and self._evictable:
            h, _ = self._evictable.popitem(last=False)
            del self._holders[h]
            self.num_free += self.chunk_blocks
        if self.num_free < num_blocks:
            return False
        self.num_free -= num_blocks
        return True

    def free(self, num_blocks: int) -> None:
        self.num_free += num_blocks
        assert self.num_free <= self.num_blocks, "freed more blocks than the pool holds"

    def publish(self, hash_ids: Sequence[int]) -> list[int]:
        """Make a request's computed chunks findable; returns the ids it now holds in the cache
        (their blocks move from the request's own count to the cache). Ids already cached by
        someone else stay the request's private copy."""
        if not self.enable_prefix_cache:
            return []
        published = []
        for h in hash_ids:
            if h not in self._holders:
                self._holders[h] = 1
                published.append(h)
        return published

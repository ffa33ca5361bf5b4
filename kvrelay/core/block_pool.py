"""Physical KV blocks: ref counts, the LRU free queue, and the hash -> block map.

A block is in exactly one of two places: held (ref_cnt > 0, by one or more requests or a
connector) or in the free queue (ref_cnt == 0). A free block may still carry a hash and be
found by prefix lookup; it keeps its KV until eviction hands it out as a fresh block.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kvrelay.core.kv_event_log import NULL_KV_EVENT_LOG, NullKVEventLog


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Chained hash of the tokens this block holds; set only once the block is full and published.
    block_hash: bytes | None = None
    # Free-queue links; both are None while the block is held.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)

    @property
    def is_free(self) -> bool:
        return self.prev_free is not None


class FreeBlockQueue:
    """Doubly linked list of free blocks, least recently freed first.

    Blocks are evicted from the front and freed to the back; a free cached block that gets a
    prefix hit leaves from the middle in O(1), which is why this is not a deque.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        # Sentinels keep every real block's links non-None while it is queued.
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def append(self, block: KVCacheBlock) -> None:
        assert not block.is_free, f"block {block.block_id} is already in the free queue"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise IndexError("pop from an empty free block queue")
        self.remove(first)
        return first

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        assert prev_block is not None and next_block is not None, f"block {block.block_id} is not free"
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self._len -= 1


class BlockPool:
    """All KV blocks of one instance.

    NOTE: a hash maps to at most one block. When two requests computed the same content into
    different blocks, both blocks carry the hash but only the first published one is in the
    map; the map entry is dropped only by the block it points at. KV events (`events`) follow
    the map: a hash entering it is stored, a hash leaving it is removed.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 events: NullKVEventLog = NULL_KV_EVENT_LOG) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}
        self.events = events

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def blocks_in_use(self) -> int:
        # NOTE: a block is out of the free queue exactly when its ref_cnt > 0.
        return self.num_blocks - len(self.free_queue)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the front of the free queue, evicting their cached
        content, each with ref_cnt 1."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {self.num_free_blocks} are free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit); free ones leave the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; those reaching 0 join the back of the free queue
        in the given order (so the first one given is evicted first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes],
                          parent_hash: bytes | None = None, token_ids: Sequence[int] = (),
                          first_token: int = 0) -> None:
        """Publish full blocks: blocks[i] holds exactly the tokens described by block_hashes[i].

        For the KV events: `parent_hash` is the hash before block_hashes[0] (None at a prompt's
        start), and blocks[i] holds token_ids[first_token + i * block_size:][:block_size].
        """
        if not self.enable_caching:
            return
        if len(blocks) != len(block_hashes):
            raise ValueError(f"got {len(blocks)} blocks but {len(block_hashes)} hashes")
        entered: list[int] = []
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes, strict=True)):
            if block.block_hash is not None:
                if block.block_hash != block_hash:
                    raise RuntimeError(f"block {block.block_id} is already published with another hash")
                continue
            block.block_hash = block_hash
            if self.cached_blocks.setdefault(block_hash, block) is block:
                entered.append(i)
        if entered:
            self.events.stored(entered, block_hashes, parent_hash, token_ids, first_token)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Forget a block's content (its KV is no longer trusted); no effect on ref counts."""
        self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is held, since a held
        block's published hash must not change under its holders."""
        if self.blocks_in_use > 0:
            return False
        self.cached_blocks.clear()
        for block in self.blocks:
            block.block_hash = None
        self.events.cleared()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            return
        block.block_hash = None
        if self.cached_blocks.get(block_hash) is block:
            del self.cached_blocks[block_hash]
            self.events.removed(block_hash)

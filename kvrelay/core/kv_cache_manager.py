"""The scheduler's only view of KV memory: prefix lookup, slot allocation, publishing, freeing."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvrelay.core.block_hash import update_block_hashes
from kvrelay.core.block_pool import BlockPool, KVCacheBlock
from kvrelay.core.kv_event_log import NULL_KV_EVENT_LOG, KVEvent, NullKVEventLog
from kvrelay.utils import cdiv

if TYPE_CHECKING:
    from kvrelay.request import Request


@dataclass(frozen=True)
class PrefixCacheStats:
    """Cumulative prefix-cache counters, counted once per admission (not per lookup)."""

    num_requests: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    """Maps each request to the list of blocks holding its KV, in token order.

    NOTE: a published block's hash describes exactly the tokens of that block position in
    `request.all_token_ids`, via the chain in `request.block_hashes`. Per request we remember how
    many leading blocks are already published, so publishing is incremental and idempotent.

    Reservations: a request admitted to wait for KV from outside holds the blocks the KV lands
    in, and must still be able to run once it arrives. `allocate_slots(..., reserve_tokens=N)`
    sets free blocks aside so that request can later grow to N tokens; no other request's
    allocation may take them. Invariant: num_free_blocks >= the blocks reserved in total.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_extra: bytes | None = None, events: NullKVEventLog = NULL_KV_EVENT_LOG) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_extra = hash_extra
        self.block_pool = BlockPool(num_blocks, enable_caching, events)
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_published_blocks: dict[str, int] = {}
        self._reserved: dict[str, int] = {}  # request id -> free blocks set aside for it
        self._num_reserved = 0
        self._stats = PrefixCacheStats()

    # ---- memory accounting --------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def blocks_in_use(self) -> int:
        return self.block_pool.blocks_in_use

    @property
    def usage(self) -> float:
        return self.blocks_in_use / self.num_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self._stats

    @property
    def num_reserved_blocks(self) -> int:
        return self._num_reserved

    def num_available_blocks(self, request_id: str) -> int:
        """Free blocks this request may take: all free blocks but those set aside for others."""
        return self.num_free_blocks - self._num_reserved + self._reserved.get(request_id, 0)

    def release_reservation(self, request_id: str) -> None:
        """Give back what was set aside for the request (it runs now, or it finished)."""
        self._num_reserved -= self._reserved.pop(request_id, 0)

    def take_events(self) -> list[KVEvent]:
        """The KV events since the last call (none without an event log)."""
        return self.block_pool.events.take()

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return list(self._req_blocks.get(request_id, ()))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._req_blocks.get(request_id, ())]

    # ---- request lifecycle --------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of the request's leading full blocks found in the prefix cache, and its
        token count. Side-effect free apart from extending `request.block_hashes`.

        The hit stops short of the last token: it must be computed to produce logits.
        """
        if not self.enable_caching:
            return [], 0
        block_hashes = update_block_hashes(request, self.block_size, self.hash_extra)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        computed_blocks = []
        for block_hash in block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed_blocks.append(block)
        return computed_blocks, len(computed_blocks) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None, num_lookahead_tokens: int = 0,
                       delay_cache_blocks: bool = False, num_external_computed_tokens: int = 0,
                       reserve_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Give the request blocks for its next tokens; None (and no change at all) when the
        pool cannot.

        `new_computed_blocks` (a prefix hit from get_computed_blocks, admission only) become
        the request's leading blocks. Fresh blocks are appended until the request can hold
        num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens +
        num_new_tokens + num_lookahead_tokens tokens; those fresh blocks are returned.
        Unless `delay_cache_blocks` (KV still arriving from outside), the blocks that will be
        full after this step are published right away. With `reserve_tokens`, enough further
        free blocks are set aside for the request to hold that many tokens later (replacing
        what was set aside for it before); the allocation fails if they are not there.
        """
        held = self._req_blocks.get(request.request_id)
        if (held is not None and 0 <= num_new_tokens and not new_computed_blocks and not reserve_tokens
                and not num_new_computed_tokens + num_external_computed_tokens + num_lookahead_tokens
                and request.num_computed_tokens + num_new_tokens <= len(held) * self.block_size):
            # NOTE: the common step (a decode in its block, a chunk in blocks it holds) takes
            # nothing from the pool and leaves the reservation as it is: no bookkeeping to do.
            if not delay_cache_blocks:
                num_tokens = min(request.num_computed_tokens + num_new_tokens, request.num_tokens)
                self.cache_blocks(request, num_tokens)
            return []
        new_computed_blocks = new_computed_blocks or []
        self._check_allocation(request, new_computed_blocks, num_new_tokens, num_new_computed_tokens,
                               num_lookahead_tokens, num_external_computed_tokens)
        held_blocks = self._req_blocks.get(request.request_id, [])
        num_computed_tokens = (request.num_computed_tokens + num_new_computed_tokens
                               + num_external_computed_tokens)
        num_tokens_to_hold = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        num_held = len(held_blocks) + len(new_computed_blocks)
        num_fresh = max(0, cdiv(num_tokens_to_hold, self.block_size) - num_held)
        # A hit on a free cached block takes that block out of the free queue too.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        num_taken = num_fresh + num_free_hits
        num_to_reserve = max(0, cdiv(reserve_tokens, self.block_size) - num_held - num_fresh)
        if num_taken + num_to_reserve > self.num_available_blocks(request.request_id):
            return None

        is_admission = request.request_id not in self._req_blocks
        if is_admission:
            self._record_admission(request, num_new_computed_tokens)
        self.block_pool.touch(new_computed_blocks)
        fresh_blocks = self.block_pool.get_new_blocks(num_fresh)
        blocks = self._req_blocks.setdefault(request.request_id, [])
        blocks.extend(new_computed_blocks)
        blocks.extend(fresh_blocks)
        if new_computed_blocks:
            # Hit blocks are published by whoever computed them.
            self._num_published_blocks[request.request_id] = len(new_computed_blocks)
        # What was set aside for this request paid for its part of this allocation.
        left = max(0, self._reserved.get(request.request_id, 0) - num_taken)
        self._set_reservation(request.request_id, left + num_to_reserve if reserve_tokens else left)

        if not delay_cache_blocks:
            self.cache_blocks(request, min(num_computed_tokens + num_new_tokens, request.num_tokens))
        return fresh_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's full blocks covering its first `num_computed_tokens` tokens.
        Idempotent; blocks already published are left alone."""
        if not self.enable_caching:
            return
        blocks = self._req_blocks.get(request.request_id)
        if not blocks:
            return
        block_hashes = update_block_hashes(request, self.block_size, self.hash_extra)
        num_full = min(num_computed_tokens // self.block_size, len(block_hashes), len(blocks))
        num_published = self._num_published_blocks.get(request.request_id, 0)
        if num_full <= num_published:
            return
        parent_hash = block_hashes[num_published - 1] if num_published else None
        self.block_pool.cache_full_blocks(blocks[num_published:num_full],
                                          block_hashes[num_published:num_full], parent_hash,
                                          request.all_token_ids, num_published * self.block_size)
        self._num_published_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks. Tail first, so that under LRU its tail is evicted
        before its head (the head is the prefix other requests are likelier to share).
        Idempotent."""
        blocks = self._req_blocks.pop(request.request_id, None)
        self._num_published_blocks.pop(request.request_id, None)
        self.release_reservation(request.request_id)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Keep only the blocks covering the first `num_tokens` tokens and free the rest
        (after a failed KV load), unpublishing every block past the valid ones (see
        `unpublish_from`). Never publishes."""
        blocks = self._req_blocks.get(request.request_id)
        if blocks is None:
            return
        self.unpublish_from(request, num_tokens)
        num_keep = cdiv(max(num_tokens, 0), self.block_size)
        dropped = blocks[num_keep:]
        del blocks[num_keep:]
        self.block_pool.free_blocks(reversed(dropped))

    def unpublish_from(self, request: Request, num_valid_tokens: int) -> None:
        """Take every block of the request from the first one not fully within its first
        `num_valid_tokens` tokens out of the prefix cache: their KV is not trusted (it was
        loaded invalid, or computed on top of such KV), so nobody may hit them.

        NOTE: whatever the ref count. Another holder of such a block hit it as part of the same
        prefix chain, so it holds the first bad block too and is rolled back with it."""
        blocks = self._req_blocks.get(request.request_id)
        if not blocks:
            return
        num_valid_full = max(num_valid_tokens, 0) // self.block_size
        for block in blocks[num_valid_full:]:
            self.block_pool.uncache_block(block)
        num_published = self._num_published_blocks.get(request.request_id, 0)
        self._num_published_blocks[request.request_id] = min(num_published, num_valid_full)

    def uncache_block_ids(self, block_ids: Iterable[int]) -> None:
        """Take these blocks out of the prefix cache, whoever holds them (ids outside the pool
        are ignored: no request can hold them)."""
        for block_id in block_ids:
            if 0 <= block_id < self.num_blocks:
                self.block_pool.uncache_block(self.block_pool.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (and nothing done) while any block is held."""
        return self.block_pool.reset_prefix_cache()

    def _check_allocation(self, request: Request, new_computed_blocks: list[KVCacheBlock],
                          *token_counts: int) -> None:
        if min(token_counts) < 0:
            raise ValueError(f"request {request.request_id}: token counts must be >= 0, got {token_counts}")
        if new_computed_blocks and self._req_blocks.get(request.request_id):
            raise ValueError(f"request {request.request_id} already holds blocks; "
                             "prefix-hit blocks are only accepted at admission")
        if any(block.block_hash is None for block in new_computed_blocks):
            raise RuntimeError(f"request {request.request_id}: a prefix-hit block was evicted since "
                               "get_computed_blocks; look up the hit right before allocating")

    def _set_reservation(self, request_id: str, num_blocks: int) -> None:
        self.release_reservation(request_id)
        if num_blocks > 0:
            self._reserved[request_id] = num_blocks
            self._num_reserved += num_blocks

    def _record_admission(self, request: Request, num_hit_tokens: int) -> None:
        if not self.enable_caching:
            return
        stats = self._stats
        self._stats = PrefixCacheStats(num_requests=stats.num_requests + 1,
                                       queried_tokens=stats.queried_tokens + request.num_tokens,
                                       hit_tokens=stats.hit_tokens + num_hit_tokens)

"""The scheduler's only view of KV memory: prefix lookup, slot allocation, publishing, freeing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvrelay.core.block_hash import update_block_hashes
from kvrelay.core.block_pool import BlockPool, KVCacheBlock

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


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps each request to the list of blocks holding its KV, in token order.

    NOTE: a published block's hash describes exactly the tokens of that block position in
    `request.all_token_ids`, via the chain in `request.block_hashes`. Per request we remember how
    many leading blocks are already published, so publishing is incremental and idempotent.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_extra: bytes | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_extra = hash_extra
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_published_blocks: dict[str, int] = {}
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

    def can_fit(self, num_blocks_needed: int) -> bool:
        return num_blocks_needed <= self.num_free_blocks

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
                       delay_cache_blocks: bool = False,
                       num_external_computed_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Give the request blocks for its next tokens; None (and no change at all) when the
        pool cannot.

        `new_computed_blocks` (a prefix hit from get_computed_blocks, admission only) become
        the request's leading blocks. Fresh blocks are appended until the request can hold
        num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens +
        num_new_tokens + num_lookahead_tokens tokens; those fresh blocks are returned.
        Unless `delay_cache_blocks` (KV still arriving from outside), the blocks that will be
        full after this step are published right away.
        """
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
        if num_fresh + num_free_hits > self.num_free_blocks:
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
        self.block_pool.cache_full_blocks(blocks[num_published:num_full],
                                          block_hashes[num_published:num_full])
        self._num_published_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks. Tail first, so that under LRU its tail is evicted
        before its head (the head is the prefix other requests are likelier to share).
        Idempotent."""
        blocks = self._req_blocks.pop(request.request_id, None)
        self._num_published_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Keep only the blocks covering the first `num_tokens` tokens and free the rest
        (after a failed KV load). Never publishes.

        Any block from the first not-fully-valid one on that is published and held by this
        request alone is unpublished: its KV is not trusted, so nobody may hit it.
        """
        blocks = self._req_blocks.get(request.request_id)
        if blocks is None:
            return
        num_valid_full = num_tokens // self.block_size
        for block in blocks[num_valid_full:]:
            if block.ref_cnt == 1 and block.block_hash is not None:
                self.block_pool.uncache_block(block)
        num_published = self._num_published_blocks.get(request.request_id, 0)
        self._num_published_blocks[request.request_id] = min(num_published, num_valid_full)

        num_keep = cdiv(max(num_tokens, 0), self.block_size)
        dropped = blocks[num_keep:]
        del blocks[num_keep:]
        self.block_pool.free_blocks(reversed(dropped))

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

    def _record_admission(self, request: Request, num_hit_tokens: int) -> None:
        if not self.enable_caching:
            return
        stats = self._stats
        self._stats = PrefixCacheStats(num_requests=stats.num_requests + 1,
                                       queried_tokens=stats.queried_tokens + request.num_tokens,
                                       hit_tokens=stats.hit_tokens + num_hit_tokens)

"""KVCacheManager: prefix hits, allocation, publishing, freeing; plus a randomized invariant check."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable
from typing import Any

import pytest

from kvrelay.core.block_hash import update_block_hashes
from kvrelay.core.block_pool import KVCacheBlock
from kvrelay.core.kv_cache_manager import KVCacheManager
from kvrelay.request import Request

BLOCK_SIZE = 4


def make_request(request_id: str, token_ids: Iterable[int]) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(token_ids), sampling_params=None)  # type: ignore[arg-type]


def make_manager(num_blocks: int = 16, **kwargs: Any) -> KVCacheManager:
    return KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE, **kwargs)


def admit(manager: KVCacheManager, request: Request, **kwargs) -> list[int] | None:
    """Admission as the scheduler does it: prefix lookup, then allocate the rest of the prompt."""
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    num_new_tokens = request.num_tokens - num_hit_tokens
    new_blocks = manager.allocate_slots(request, num_new_tokens, num_hit_tokens, hit_blocks, **kwargs)
    if new_blocks is None:
        return None
    request.num_computed_tokens = num_hit_tokens + num_new_tokens
    return [block.block_id for block in new_blocks]


def must_allocate(manager: KVCacheManager, request: Request, *args: Any, **kwargs: Any) -> list[KVCacheBlock]:
    new_blocks = manager.allocate_slots(request, *args, **kwargs)
    assert new_blocks is not None
    return new_blocks


def pool_snapshot(manager: KVCacheManager, *requests: Request) -> tuple:
    pool = manager.block_pool
    return ([(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
            [b.block_id for b in pool.free_queue],
            {h: b.block_id for h, b in pool.cached_blocks.items()},
            [manager.get_block_ids(r.request_id) for r in requests],
            [len(r.block_hashes) for r in requests])


def assert_consistent(manager: KVCacheManager, live_requests: list[Request]) -> None:
    """Ref counts == holders, free queue == blocks with ref 0, map entries match block hashes,
    each request's published blocks carry its own chain's hashes."""
    pool = manager.block_pool
    holders = Counter(b.block_id for r in live_requests for b in manager.get_blocks(r.request_id))
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], block
    assert {b.block_id for b in pool.free_queue} == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    assert len(pool.free_queue) == pool.num_free_blocks == len(list(pool.free_queue))
    for block_hash, block in pool.cached_blocks.items():
        assert block.block_hash == block_hash
    for request in live_requests:
        blocks = manager.get_blocks(request.request_id)
        for block, block_hash in zip(blocks, request.block_hashes, strict=False):
            assert block.block_hash in (None, block_hash)


# ---- prefix hits ---------------------------------------------------------------------------


def test_second_identical_prompt_hits_first_requests_published_blocks():
    manager = make_manager()
    first, second = make_request("a", range(10)), make_request("b", range(10))
    first_ids = admit(manager, first)
    assert first_ids is not None
    blocks, num_tokens = manager.get_computed_blocks(second)
    assert num_tokens == 8 and [b.block_id for b in blocks] == first_ids[:2]
    manager.free(first)
    # Still a hit after the first request is gone: freed blocks stay cached.
    blocks, num_tokens = manager.get_computed_blocks(second)
    assert num_tokens == 8 and [b.block_id for b in blocks] == first_ids[:2]
    assert admit(manager, second) is not None
    assert manager.get_block_ids("b")[:2] == first_ids[:2]
    manager.free(second)
    assert manager.blocks_in_use == 0


def test_get_computed_blocks_is_side_effect_free():
    manager = make_manager()
    writer, reader = make_request("a", range(12)), make_request("b", range(13))
    admit(manager, writer)
    manager.free(writer)
    before = pool_snapshot(manager)
    first = manager.get_computed_blocks(reader)
    second = manager.get_computed_blocks(reader)
    assert first == second and first[1] == 12
    assert pool_snapshot(manager) == before
    assert manager.blocks_in_use == 0


def test_hit_never_covers_the_last_token():
    manager = make_manager()
    writer = make_request("a", range(8))
    admit(manager, writer)
    # Exactly two full blocks, both cached: only the first may be a hit.
    blocks, num_tokens = manager.get_computed_blocks(make_request("b", range(8)))
    assert num_tokens == 4 and len(blocks) == 1
    blocks, num_tokens = manager.get_computed_blocks(make_request("c", range(9)))
    assert num_tokens == 8
    manager.free(writer)
    assert manager.blocks_in_use == 0


def test_different_salt_never_hits():
    manager = make_manager(hash_extra=b"model-a")
    writer = make_request("a", range(12))
    admit(manager, writer)
    other = make_manager(hash_extra=b"model-b")
    assert other.get_computed_blocks(make_request("b", range(12))) == ([], 0)
    manager.free(writer)
    assert manager.blocks_in_use == 0


def test_caching_disabled_gives_no_hits():
    manager = make_manager(enable_caching=False)
    writer = make_request("a", range(12))
    admit(manager, writer)
    assert manager.get_computed_blocks(make_request("b", range(12))) == ([], 0)
    assert manager.block_pool.cached_blocks == {}
    manager.free(writer)
    assert manager.blocks_in_use == 0


def test_shared_prefix_is_ref_counted():
    manager = make_manager()
    first, second = make_request("a", range(10)), make_request("b", list(range(8)) + [50, 51])
    admit(manager, first)
    admit(manager, second)
    shared = manager.get_blocks("a")[:2]
    assert manager.get_blocks("b")[:2] == shared and all(b.ref_cnt == 2 for b in shared)
    assert manager.blocks_in_use == 4
    manager.free(first)
    assert all(b.ref_cnt == 1 for b in shared) and manager.blocks_in_use == 3
    assert_consistent(manager, [second])
    manager.free(second)
    manager.free(second)  # idempotent
    assert manager.blocks_in_use == 0


# ---- allocation ----------------------------------------------------------------------------


def test_allocation_grows_only_by_missing_blocks_and_publishes_full_ones():
    manager = make_manager()
    request = make_request("a", range(6))
    # Chunked prefill: 3 tokens, then 3 more.
    assert len(must_allocate(manager, request, 3)) == 1
    assert manager.block_pool.cached_blocks == {}
    request.num_computed_tokens = 3
    assert len(must_allocate(manager, request, 3)) == 1
    request.num_computed_tokens = 6
    assert len(manager.block_pool.cached_blocks) == 1
    # Decode: sampled tokens fill the second block; it is published once its last token is scheduled.
    for token in (100, 101):
        request.append_output_token_ids(token)
        assert manager.allocate_slots(request, 1) == []
        request.num_computed_tokens += 1
    assert len(manager.block_pool.cached_blocks) == 2
    assert manager.get_blocks("a")[1].block_hash == request.block_hashes[1]
    manager.free(request)
    assert manager.blocks_in_use == 0


def test_lookahead_slots_are_allocated_but_not_published():
    manager = make_manager()
    request = make_request("a", range(3))
    assert len(must_allocate(manager, request, 3, num_lookahead_tokens=6)) == 3
    assert manager.block_pool.cached_blocks == {}
    manager.free(request)
    assert manager.blocks_in_use == 0


def test_failed_allocation_changes_nothing():
    manager = make_manager(num_blocks=4)
    writer = make_request("a", range(9))
    admit(manager, writer)
    manager.free(writer)  # 3 free blocks cached, 1 never used
    reader = make_request("b", list(range(9)) + list(range(100, 112)))  # needs 6 blocks, 2 are hits
    before = pool_snapshot(manager, reader)
    manager.get_computed_blocks(reader)  # fill block_hashes so the snapshot compares like with like
    before = pool_snapshot(manager, reader)
    assert admit(manager, reader) is None
    assert pool_snapshot(manager, reader) == before
    assert manager.prefix_cache_stats.num_requests == 1
    assert manager.blocks_in_use == 0


def test_capacity_counts_hits_on_free_cached_blocks():
    manager = make_manager(num_blocks=5)
    writer = make_request("a", range(9))
    admit(manager, writer)
    manager.free(writer)  # blocks 0..2 free and cached (0, 1 full), 3..4 free
    # 2 hit blocks (free) + 4 fresh = 6 > 5 free: refused, although 4 fresh alone would fit.
    assert admit(manager, make_request("b", list(range(8)) + list(range(100, 116)))) is None
    # 2 hit blocks + 3 fresh = 5: fits exactly.
    fits = make_request("c", list(range(8)) + list(range(100, 112)))
    assert admit(manager, fits) is not None
    assert manager.num_free_blocks == 0 and manager.usage == 1.0
    manager.free(fits)
    assert manager.blocks_in_use == 0


def test_hit_blocks_are_only_accepted_at_admission():
    manager = make_manager()
    writer, reader = make_request("a", range(9)), make_request("b", range(9))
    admit(manager, writer)
    manager.allocate_slots(reader, 1)
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(reader)
    with pytest.raises(ValueError, match="already holds blocks"):
        manager.allocate_slots(reader, 1, num_hit_tokens, hit_blocks)
    manager.free(writer)
    manager.free(reader)
    assert manager.blocks_in_use == 0


# ---- delayed publishing (KV arriving from outside) -----------------------------------------


def test_delay_cache_blocks_hides_blocks_until_cache_blocks():
    manager = make_manager()
    request = make_request("a", range(13))
    new_blocks = must_allocate(manager, request, 0, delay_cache_blocks=True, num_external_computed_tokens=12)
    assert len(new_blocks) == 3
    assert manager.block_pool.cached_blocks == {}
    assert manager.get_computed_blocks(make_request("b", range(13))) == ([], 0)
    manager.cache_blocks(request, 12)  # the load finished
    manager.cache_blocks(request, 12)  # idempotent
    assert manager.get_computed_blocks(make_request("c", range(13)))[1] == 12
    manager.free(request)
    assert manager.blocks_in_use == 0


def test_delayed_load_on_top_of_a_local_hit():
    manager = make_manager()
    writer = make_request("a", range(5))
    admit(manager, writer)
    request = make_request("b", range(13))
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    assert num_hit_tokens == 4
    new_blocks = must_allocate(manager, request, 0, num_hit_tokens, hit_blocks, delay_cache_blocks=True,
                                        num_external_computed_tokens=8)
    assert len(new_blocks) == 2 and manager.get_blocks("b")[0] is hit_blocks[0]
    assert len(manager.block_pool.cached_blocks) == 1
    manager.cache_blocks(request, 12)
    assert len(manager.block_pool.cached_blocks) == 3
    manager.free(writer)
    manager.free(request)
    assert manager.blocks_in_use == 0


def test_truncate_keeps_valid_leading_blocks_and_unpublishes_the_rest():
    manager = make_manager()
    request = make_request("a", range(17))
    manager.allocate_slots(request, 0, delay_cache_blocks=True, num_external_computed_tokens=16)
    assert len(manager.get_blocks("a")) == 4
    manager.truncate(request, 6)  # only the first 6 tokens arrived intact
    assert len(manager.get_blocks("a")) == 2 and manager.blocks_in_use == 2
    manager.cache_blocks(request, 6)
    assert len(manager.block_pool.cached_blocks) == 1
    # Recompute the rest: grows again and publishes from block 1 on.
    request.num_computed_tokens = 6
    manager.allocate_slots(request, 11)
    assert len(manager.get_blocks("a")) == 5 and len(manager.block_pool.cached_blocks) == 4
    manager.free(request)
    assert manager.blocks_in_use == 0


def test_truncate_drops_hashes_published_for_blocks_that_failed():
    manager = make_manager()
    request = make_request("a", range(12))
    manager.allocate_slots(request, 0, num_external_computed_tokens=12)  # published eagerly
    assert len(manager.block_pool.cached_blocks) == 3
    manager.truncate(request, 5)
    assert len(manager.block_pool.cached_blocks) == 1
    manager.free(request)
    assert manager.blocks_in_use == 0


def test_unpublish_from_drops_shared_blocks_too():
    manager = make_manager()
    loader = make_request("a", range(13))
    must_allocate(manager, loader, 0, num_external_computed_tokens=12)  # published eagerly
    hitter = make_request("b", range(13))
    assert admit(manager, hitter) is not None  # hit all three blocks: each is held twice
    manager.unpublish_from(loader, 4)  # block 1 turned out invalid
    assert len(manager.block_pool.cached_blocks) == 1
    assert manager.get_computed_blocks(make_request("c", range(13)))[1] == 4
    manager.uncache_block_ids({0, 999})  # ids outside the pool are ignored
    assert not manager.block_pool.cached_blocks
    manager.free(loader)
    manager.free(hitter)
    assert manager.blocks_in_use == 0


# ---- reservations --------------------------------------------------------------------------


def test_reserved_blocks_are_kept_from_other_requests():
    manager = make_manager(num_blocks=8)
    loader = make_request("a", range(20))  # 5 blocks in all
    # Loads 8 tokens (2 blocks) and sets aside what its whole prompt needs: 3 more blocks.
    must_allocate(manager, loader, 0, delay_cache_blocks=True, num_external_computed_tokens=8,
                  reserve_tokens=20)
    assert manager.num_free_blocks == 6 and manager.num_reserved_blocks == 3
    assert manager.num_available_blocks("other") == 3 and manager.num_available_blocks("a") == 6
    greedy = make_request("g", range(100, 116))  # 4 blocks: only 3 are not set aside
    manager.get_computed_blocks(greedy)  # fill block_hashes so the snapshot compares like with like
    before = pool_snapshot(manager, greedy)
    assert admit(manager, greedy) is None
    assert pool_snapshot(manager, greedy) == before
    small = make_request("s", range(200, 212))
    assert admit(manager, small) is not None  # 3 blocks fit beside the reservation
    assert manager.num_free_blocks == manager.num_reserved_blocks == 3
    # The loader's first step afterwards takes its reserved blocks; then nothing is set aside.
    loader.num_computed_tokens = 8
    assert len(must_allocate(manager, loader, 12)) == 3
    assert manager.num_reserved_blocks == 0
    for request in (loader, small):
        manager.free(request)
    assert manager.blocks_in_use == 0


def test_reservation_refused_when_it_does_not_fit_and_released_on_free():
    manager = make_manager(num_blocks=6)
    loader = make_request("a", range(24))  # 6 blocks in all
    other = make_request("o", range(100, 104))
    assert admit(manager, other) is not None
    # Its 2 loaded blocks fit, but with 4 more set aside it needs 6 of the 5 free: refused.
    before = pool_snapshot(manager, loader)
    assert manager.allocate_slots(loader, 0, num_external_computed_tokens=8, reserve_tokens=24) is None
    assert pool_snapshot(manager, loader) == before and manager.num_reserved_blocks == 0
    manager.free(other)
    must_allocate(manager, loader, 0, num_external_computed_tokens=8, reserve_tokens=24)
    assert manager.num_reserved_blocks == 4
    manager.free(loader)  # finished (aborted) before it ran: nothing stays set aside
    assert manager.num_reserved_blocks == 0 and manager.blocks_in_use == 0


# ---- eviction, duplicates, reset, stats ----------------------------------------------------


def test_freed_request_tail_is_evicted_before_its_head():
    manager = make_manager(num_blocks=4)
    request = make_request("a", range(12))
    admit(manager, request)
    ids = manager.get_block_ids("a")
    manager.free(request)
    other = make_request("b", [900, 901])
    assert admit(manager, other) == [3]  # never used: first out
    third = make_request("c", [800, 801])
    assert admit(manager, third) == [ids[-1]]
    assert manager.get_computed_blocks(make_request("d", range(12)))[1] == 8  # head survives
    manager.free(other)
    manager.free(third)
    assert manager.blocks_in_use == 0


def test_concurrent_identical_prompts_computed_twice_stay_consistent():
    manager = make_manager(num_blocks=8)
    first, second = make_request("a", range(9)), make_request("b", range(9))
    # Both looked up before either was allocated: neither hits, both compute and publish.
    lookups = [manager.get_computed_blocks(first), manager.get_computed_blocks(second)]
    assert lookups == [([], 0), ([], 0)]
    manager.allocate_slots(first, 9)
    manager.allocate_slots(second, 9)
    first_head = manager.get_blocks("a")[0]
    assert manager.block_pool.get_cached_block(first.block_hashes[0]) is first_head
    manager.free(second)
    manager.free(first)
    assert_consistent(manager, [])
    # Evict everything in turn; the map never points at a block that lost its hash.
    filler = make_request("f", range(1000, 1032))
    assert admit(manager, filler) is not None
    assert manager.block_pool.cached_blocks.keys() <= {h for h in filler.block_hashes}
    assert_consistent(manager, [filler])
    manager.free(filler)
    assert manager.blocks_in_use == 0


def test_reset_prefix_cache():
    manager = make_manager()
    request = make_request("a", range(9))
    admit(manager, request)
    assert manager.reset_prefix_cache() is False
    manager.free(request)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request("b", range(9))) == ([], 0)
    assert manager.blocks_in_use == 0


def test_prefix_cache_stats_count_each_admission_once():
    manager = make_manager()
    first, second = make_request("a", range(9)), make_request("b", range(9))
    admit(manager, first)
    for _ in range(3):
        manager.get_computed_blocks(second)  # retried lookups are not counted
    admit(manager, second)
    stats = manager.prefix_cache_stats
    assert (stats.num_requests, stats.queried_tokens, stats.hit_tokens) == (2, 18, 8)
    assert stats.hit_rate == pytest.approx(8 / 18)
    manager.free(first)
    manager.free(second)
    assert manager.blocks_in_use == 0


# ---- randomized ----------------------------------------------------------------------------


class _Simulation:
    """Drives the manager like a scheduler and a model would, and models each block's KV
    content, so that every hit can be checked against the tokens it claims to hold."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.manager = KVCacheManager(num_blocks=24, block_size=BLOCK_SIZE)
        self.content: dict[int, list[int | None]] = {}
        self.live: dict[str, Request] = {}
        self.loading: dict[str, int] = {}  # request id -> tokens its external load will fill
        self.prefixes = [[self.rng.randrange(50) for _ in range(self.rng.randint(4, 14))] for _ in range(3)]
        self.next_id = 0

    def write(self, request: Request, start: int, end: int) -> None:
        blocks = self.manager.get_blocks(request.request_id)
        for pos in range(start, end):
            block = blocks[pos // BLOCK_SIZE]
            assert block.ref_cnt == 1, "writing into a block another request holds"
            self.content[block.block_id][pos % BLOCK_SIZE] = request.all_token_ids[pos]

    def allocate(self, request: Request, *args, **kwargs) -> bool:
        new_blocks = self.manager.allocate_slots(request, *args, **kwargs)
        for block in new_blocks or ():
            self.content[block.block_id] = [None] * BLOCK_SIZE  # fresh: old KV is overwritten
        return new_blocks is not None

    def admit(self) -> None:
        suffix = [self.rng.randrange(50) for _ in range(self.rng.randint(1, 8))]
        tokens = self.rng.choice(self.prefixes) + suffix
        request = make_request(f"r{self.next_id}", tokens)
        self.next_id += 1
        hit_blocks, num_hit = self.manager.get_computed_blocks(request)
        for i, block in enumerate(hit_blocks):
            assert self.content[block.block_id] == tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
        if self.rng.random() < 0.3:  # KV for the rest of the prompt (but the last token) arrives later
            num_external = request.num_tokens - 1 - num_hit
            if self.allocate(request, 0, num_hit, hit_blocks, delay_cache_blocks=True,
                             num_external_computed_tokens=num_external):
                self.live[request.request_id] = request
                self.loading[request.request_id] = num_hit + num_external
                request.num_computed_tokens = num_hit
            return
        chunk = self.rng.randint(1, request.num_tokens - num_hit)
        if self.allocate(request, chunk, num_hit, hit_blocks):
            self.live[request.request_id] = request
            self.write(request, num_hit, num_hit + chunk)
            request.num_computed_tokens = num_hit + chunk

    def finish_load(self, request: Request) -> None:
        loaded = self.loading.pop(request.request_id)
        if self.rng.random() < 0.3:  # failed part-way: keep the valid head, recompute the rest
            loaded = self.rng.randint(request.num_computed_tokens, loaded)
            self.manager.truncate(request, loaded)
        self.write(request, request.num_computed_tokens, loaded)
        self.manager.cache_blocks(request, loaded)
        request.num_computed_tokens = loaded

    def advance(self, request: Request) -> None:
        if request.num_computed_tokens == request.num_tokens:  # decode: a token was sampled
            request.append_output_token_ids(self.rng.randrange(50))
        num_new = self.rng.randint(1, request.num_tokens - request.num_computed_tokens)
        start = request.num_computed_tokens
        if self.allocate(request, num_new):
            self.write(request, start, start + num_new)
            request.num_computed_tokens = start + num_new

    def step(self) -> None:
        action = self.rng.random()
        if action < 0.35 or not self.live:
            self.admit()
            return
        request = self.live[self.rng.choice(sorted(self.live))]
        if action < 0.75:
            if request.request_id in self.loading:
                self.finish_load(request)
            else:
                self.advance(request)
        else:
            self.loading.pop(request.request_id, None)
            self.manager.free(self.live.pop(request.request_id))

    def check(self) -> None:
        live = list(self.live.values())
        for request in live:
            update_block_hashes(request, BLOCK_SIZE)
        assert_consistent(self.manager, live)
        # Every published block holds exactly the tokens its hash describes.
        for request in live:
            if request.request_id in self.loading:
                continue
            blocks = self.manager.get_blocks(request.request_id)
            for i, block in enumerate(blocks[:request.num_computed_tokens // BLOCK_SIZE]):
                if block.block_hash is not None:
                    assert block.block_hash == request.block_hashes[i]
                    tokens = request.all_token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
                    assert self.content[block.block_id] == tokens


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_pool_invariants(seed: int):
    sim = _Simulation(seed)
    for _ in range(300):
        sim.step()
        sim.check()
    for request_id in sorted(sim.live):
        sim.manager.free(sim.live.pop(request_id))
    assert_consistent(sim.manager, [])
    assert sim.manager.blocks_in_use == 0
    assert sim.manager.prefix_cache_stats.hit_tokens > 0

"""Block hashes, the LRU free queue and the block pool."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.core.block_hash import hash_block_tokens, update_block_hashes
from kvrelay.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from kvrelay.request import Request

REPO_ROOT = Path(__file__).resolve().parents[2]


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id=request_id, prompt_token_ids=token_ids, sampling_params=None)  # type: ignore[arg-type]


def chain(token_ids: list[int], block_size: int, extra: bytes | None = None) -> list[bytes]:
    return update_block_hashes(make_request("r", token_ids), block_size, extra)


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_queue]


# ---- block hashes --------------------------------------------------------------------------


def test_same_prefix_gives_same_hashes_and_only_full_blocks_are_hashed():
    a = chain(list(range(10)), block_size=4)
    b = chain(list(range(8)) + [99, 98, 97], block_size=4)
    assert len(a) == 2 and len(b) == 2
    assert a == b


def test_changed_early_token_changes_every_later_hash():
    tokens = list(range(16))
    changed = [1000] + tokens[1:]
    a, b = chain(tokens, 4), chain(changed, 4)
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_same_block_under_different_parent_hashes_differently():
    block = [5, 6, 7, 8]
    assert hash_block_tokens(None, block) != hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), block)


def test_extra_salt_separates_otherwise_equal_chains():
    tokens = list(range(8))
    assert chain(tokens, 4, b"tenant-a") != chain(tokens, 4, b"tenant-b")
    assert chain(tokens, 4, b"") != chain(tokens, 4, None)
    assert chain(tokens, 4, b"tenant-a") == chain(tokens, 4, b"tenant-a")


def test_update_block_hashes_is_incremental():
    request = make_request("r", list(range(6)))
    first = list(update_block_hashes(request, 4))
    assert len(first) == 1
    request.append_output_token_ids([6, 7, 8])
    update_block_hashes(request, 4)
    assert request.block_hashes[:1] == first
    assert request.block_hashes == chain(list(range(9)), 4)


def test_hashes_are_deterministic_across_processes():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 50_000, 2**40]
    script = (
        "from kvrelay.core.block_hash import hash_block_tokens as h\n"
        f"print(h(h(None, {tokens[:5]}, b'x'), {tokens[5:]}, b'x').hex())\n"
    )
    # A fresh interpreter with a different PYTHONHASHSEED must agree with this one.
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                            env={"PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)})
    expected = hash_block_tokens(hash_block_tokens(None, tokens[:5], b"x"), tokens[5:], b"x")
    assert result.stdout.strip() == expected.hex()


# ---- free queue ----------------------------------------------------------------------------


def test_free_queue_pops_in_order_and_removes_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3] and len(queue) == 3
    assert not blocks[2].is_free
    queue.append(blocks[2])
    assert [queue.popleft().block_id for _ in range(4)] == [0, 1, 3, 2]
    with pytest.raises(IndexError):
        queue.popleft()


# ---- block pool ----------------------------------------------------------------------------


def test_new_blocks_come_from_the_front_and_freed_blocks_go_to_the_back():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2] and all(b.ref_cnt == 1 for b in blocks)
    pool.free_blocks([blocks[1], blocks[0]])
    assert free_ids(pool) == [3, 1, 0]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 1]
    assert pool.blocks_in_use == 3


def test_allocating_more_than_free_raises():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.get_new_blocks(3)


def test_evicting_a_cached_block_drops_its_hash_from_the_map():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [b"h0"])
    pool.free_blocks([block])
    assert pool.get_cached_block(b"h0") is block  # free but still reusable
    pool.get_new_blocks(2)
    assert block.block_hash is None and pool.get_cached_block(b"h0") is None


def test_touching_a_free_cached_block_takes_it_out_of_the_queue():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [b"a", b"b", b"c"])
    pool.free_blocks(blocks)
    pool.touch([pool.get_cached_block(b"b")])  # type: ignore[list-item]
    assert free_ids(pool) == [0, 2] and blocks[1].ref_cnt == 1
    pool.touch([blocks[1]])  # a second holder: no queue change
    assert blocks[1].ref_cnt == 2 and pool.num_free_blocks == 2
    pool.free_blocks([blocks[1], blocks[1]])
    assert pool.blocks_in_use == 0


def test_freeing_a_free_block_is_an_error():
    pool = BlockPool(1)
    blocks = pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free_blocks(blocks)


def test_duplicate_hash_keeps_the_first_block_and_eviction_of_either_is_safe():
    pool = BlockPool(3)
    first, second, spare = pool.get_new_blocks(3)
    pool.cache_full_blocks([first], [b"same"])
    pool.cache_full_blocks([second], [b"same"])
    assert pool.get_cached_block(b"same") is first and second.block_hash == b"same"
    pool.free_blocks([second, spare, first])
    pool.get_new_blocks(1)  # evicts `second`: must not unpublish `first`
    assert pool.get_cached_block(b"same") is first
    pool.get_new_blocks(2)  # evicts `first`
    assert pool.get_cached_block(b"same") is None


def test_republishing_with_a_different_hash_is_refused():
    pool = BlockPool(1)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [b"x"])
    pool.cache_full_blocks(blocks, [b"x"])  # idempotent
    with pytest.raises(RuntimeError, match="another hash"):
        pool.cache_full_blocks(blocks, [b"y"])
    pool.free_blocks(blocks)


def test_caching_disabled_publishes_nothing():
    pool = BlockPool(1, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [b"x"])
    assert pool.get_cached_block(b"x") is None and blocks[0].block_hash is None
    pool.free_blocks(blocks)


def test_reset_prefix_cache_only_when_nothing_is_held():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"a", b"b"])
    pool.free_blocks(blocks[:1])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"a") is blocks[0]
    pool.free_blocks(blocks[1:])
    assert pool.reset_prefix_cache() is True
    assert pool.cached_blocks == {} and all(b.block_hash is None for b in pool.blocks)
    assert pool.blocks_in_use == 0

"""nixl_tp.plan_reads: which P ranks each D rank reads which bytes of a block from, whatever the
two TP sizes, and how many readers each P rank must wait for."""

from __future__ import annotations

import pytest

from kvrelay.kv_transfer.p2p.tp_plan import plan_reads, plan_writes, releaser
from kvrelay.kv_transfer.transport.base import ByteRange

HB = 100  # one head's K (or V) bytes in a block


def test_equal_sizes_read_whole_blocks_rank_to_rank() -> None:
    for rank in range(2):
        plan = plan_reads(2, 2, 2, rank, HB)
        assert [(r.p_rank, r.ranges, r.num_readers) for r in plan.reads] == [(rank, None, 1)]
        assert plan.releases == ()


def test_a_larger_decode_reads_its_heads_slice_of_one_p_rank() -> None:
    """P tp 1 holds heads 0, 1 ([2, 2, bs, D] blocks); D rank 1 holds head 1 alone."""
    plan = plan_reads(2, 1, 2, 1, HB)
    (read,) = plan.reads
    assert read.p_rank == 0 and read.num_readers == 2 and read.remote_block_bytes == 4 * HB
    assert read.ranges == (ByteRange(HB, 0, HB), ByteRange(3 * HB, HB, HB))


def test_a_smaller_decode_reads_each_p_ranks_heads_into_their_slice() -> None:
    plan = plan_reads(2, 2, 1, 0, HB)
    assert [(r.p_rank, r.ranges, r.num_readers) for r in plan.reads] == [
        (0, (ByteRange(0, 0, HB), ByteRange(HB, 2 * HB, HB)), 1),
        (1, (ByteRange(0, HB, HB), ByteRange(HB, 3 * HB, HB)), 1)]


def test_a_replicated_head_is_read_once_and_the_other_replicas_are_released() -> None:
    plan = plan_reads(2, 4, 1, 0, HB)  # P ranks 0, 1 hold head 0; 2, 3 head 1
    assert [r.p_rank for r in plan.reads] == [0, 2]
    assert [(r.p_rank, r.num_readers) for r in plan.releases] == [(1, 1), (3, 1)]


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("p_tp", [1, 2, 4])
@pytest.mark.parametrize("d_tp", [1, 2, 4])
def test_every_d_block_is_filled_once_and_every_p_rank_is_read_or_released(
        num_kv_heads: int, p_tp: int, d_tp: int) -> None:
    plans = [plan_reads(num_kv_heads, p_tp, d_tp, d, HB) for d in range(d_tp)]
    readers = {p: sum(any(r.p_rank == p for r in plan.reads) for plan in plans) for p in range(p_tp)}
    released = [r.p_rank for plan in plans for r in plan.releases]
    for plan in plans:
        local_heads = max(1, num_kv_heads // d_tp)
        covered = sorted((r.local_offset, r.length) for read in plan.reads
                         for r in (read.ranges or (ByteRange(0, 0, 2 * local_heads * HB),)))
        assert sum(length for _, length in covered) == 2 * local_heads * HB  # no gap, no overlap
        assert all(a + n == b for (a, n), (b, _) in zip(covered, covered[1:], strict=False))
        assert all(read.num_readers == readers[read.p_rank] for read in plan.reads)
    assert sorted(released) == [p for p in range(p_tp) if readers[p] == 0]


def test_a_size_that_cannot_hold_the_heads_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        plan_reads(2, 3, 1, 0, HB)
    with pytest.raises(ValueError, match="P tp_size 0"):  # a malformed params' tp_size
        plan_reads(2, 0, 1, 0, HB)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("p_tp", [1, 2, 4])
@pytest.mark.parametrize("d_tp", [1, 2, 4])
def test_a_push_writes_to_exactly_the_d_ranks_whose_plan_reads_from_it(
        num_kv_heads: int, p_tp: int, d_tp: int) -> None:
    """P computes the plan itself: rank p writes to D rank d exactly what d's plan reads from p, and
    a P rank with no writer is released by D rank p % d_tp."""
    for p_rank in range(p_tp):
        writes = plan_writes(num_kv_heads, p_tp, d_tp, p_rank, HB)
        for d_rank in range(d_tp):
            plan = plan_reads(num_kv_heads, p_tp, d_tp, d_rank, HB)
            from_p = [r for r in plan.reads if r.p_rank == p_rank]
            assert writes.get(d_rank) == (from_p[0] if from_p else None)
            assert all(read.num_readers == len(writes) for read in from_p)
            released = [r.p_rank for r in plan.releases]
            assert (p_rank in released) == (not writes and releaser(p_rank, d_tp) == d_rank)


def test_a_push_from_tp1_to_tp2_writes_each_d_rank_its_heads_slice() -> None:
    writes = plan_writes(2, 1, 2, 0, HB)
    assert {d: r.ranges for d, r in writes.items()} == {
        0: (ByteRange(0, 0, HB), ByteRange(2 * HB, HB, HB)),
        1: (ByteRange(HB, 0, HB), ByteRange(3 * HB, HB, HB))}
    with pytest.raises(ValueError, match="outside tensor_parallel_size"):
        plan_writes(2, 1, 2, 1, HB)

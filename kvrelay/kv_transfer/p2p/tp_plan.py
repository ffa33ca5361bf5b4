"""Which of P's ranks one of D's ranks reads its KV heads from, when the TP sizes may differ.

Every rank of either instance holds whole KV heads of every block (kvrelay/model/sharding.py):
a contiguous share of them, or one head shared by several ranks when there are more ranks than
heads. Within a block heads are outer, [2, H_shard, block_size, D], so a run of heads is one byte
range in the K half and one in the V half. A D rank therefore reads, from each P rank that holds
some of its heads, two byte ranges of every block (or whole blocks when both shards hold exactly
the same heads, as between equal TP sizes).

A head several P ranks hold is read once, from one of them: D rank d picks replica d % replicas,
which spreads the D ranks over the replicas. Every D rank computes the same plan for all D ranks,
so each knows how many D ranks read from each P rank: that count is the `n` of the notification
`"{request_id}:{n}"` P waits for. A P rank no D rank reads from is told by one D rank (the one
whose rank is the P rank's modulo D's size) to release its blocks, so it frees them at once.

A push runs the same plan the other way (`plan_writes`): P's rank computes every D rank's plan
and writes to the D ranks whose plan reads from it, exactly the byte ranges that plan names, so
neither side trusts the other's ranges.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kvrelay.kv_transfer.transport.base import ByteRange
from kvrelay.model.sharding import kv_heads_of_rank


@dataclass(frozen=True)
class RankRead:
    """What one D rank reads from (or, in `ReadPlan.releases`, only releases at) one P rank."""

    p_rank: int
    ranges: tuple[ByteRange, ...] | None  # of each block; None: whole blocks
    num_readers: int  # D ranks that read from this P rank: the notification's count
    remote_block_bytes: int  # the size of one of this P rank's blocks (checked in the handshake)


@dataclass(frozen=True)
class ReadPlan:
    reads: tuple[RankRead, ...]  # in D's head order
    releases: tuple[RankRead, ...]  # P ranks nobody reads from that this D rank tells to free


@functools.cache  # NOTE: a handful of distinct arguments per instance; asked once per request
def plan_reads(num_kv_heads: int, p_tp: int, d_tp: int, d_rank: int, head_bytes: int) -> ReadPlan:
    """The plan of D rank `d_rank` (of `d_tp`) pulling from a P of `p_tp` ranks. `num_kv_heads` is
    the model's; `head_bytes` one head's K (or V) in one block. ValueError when a size cannot
    hold the model's KV heads."""
    if p_tp < 1 or d_tp < 1 or not 0 <= d_rank < d_tp:
        raise ValueError(f"tensor-parallel sizes must be positive and the rank inside its group, got "
                         f"P tp_size {p_tp}, D tp_size {d_tp}, D rank {d_rank}")
    sources = [_sources(num_kv_heads, p_tp, d_tp, d) for d in range(d_tp)]
    readers = {p: sum(1 for runs in sources if any(run[0] == p for run in runs)) for p in range(p_tp)}
    d_heads = kv_heads_of_rank(num_kv_heads, d_tp, d_rank)
    reads = []
    for p_rank, heads in sources[d_rank]:
        p_heads = kv_heads_of_rank(num_kv_heads, p_tp, p_rank)
        reads.append(RankRead(p_rank, _head_ranges(heads, p_heads, d_heads, head_bytes), readers[p_rank],
                              2 * len(p_heads) * head_bytes))
    releases = tuple(
        RankRead(p, None, 1, 2 * len(kv_heads_of_rank(num_kv_heads, p_tp, p)) * head_bytes)
        for p in range(p_tp) if readers[p] == 0 and p % d_tp == d_rank)
    return ReadPlan(tuple(reads), releases)


def _sources(num_kv_heads: int, p_tp: int, d_tp: int, d_rank: int) -> list[tuple[int, range]]:
    """(P rank, run of heads) for D rank `d_rank`'s heads, runs of consecutive heads merged."""
    runs: list[tuple[int, range]] = []
    for head in kv_heads_of_rank(num_kv_heads, d_tp, d_rank):
        p_rank = _holder(num_kv_heads, p_tp, head, d_rank)
        if runs and runs[-1][0] == p_rank and runs[-1][1].stop == head:
            runs[-1] = (p_rank, range(runs[-1][1].start, head + 1))
        else:
            runs.append((p_rank, range(head, head + 1)))
    return runs


def _holder(num_kv_heads: int, p_tp: int, head: int, d_rank: int) -> int:
    """The P rank D rank `d_rank` reads `head` from."""
    kv_heads_of_rank(num_kv_heads, p_tp, 0)  # NOTE: raises for a size that cannot hold the heads
    if num_kv_heads % p_tp == 0:
        return head // (num_kv_heads // p_tp)
    replicas = p_tp // num_kv_heads
    return head * replicas + d_rank % replicas


def _head_ranges(heads: range, p_heads: range, d_heads: range,
                 head_bytes: int) -> tuple[ByteRange, ...] | None:
    """The K and V byte ranges of `heads` in a P block holding `p_heads` and a D block holding
    `d_heads` (blocks are [2, H_shard, block_size, D]); None when both blocks are exactly them."""
    if heads == p_heads == d_heads:
        return None
    length = len(heads) * head_bytes
    k_remote = (heads.start - p_heads.start) * head_bytes
    k_local = (heads.start - d_heads.start) * head_bytes
    v_remote = k_remote + len(p_heads) * head_bytes
    v_local = k_local + len(d_heads) * head_bytes
    return ByteRange(k_remote, k_local, length), ByteRange(v_remote, v_local, length)


@functools.cache
def plan_writes(num_kv_heads: int, p_tp: int, d_tp: int, p_rank: int, head_bytes: int) -> dict[int, RankRead]:
    """Push: the D ranks (of `d_tp`) that take their KV heads from P rank `p_rank` (of `p_tp`), each
    with the RankRead of its own plan for this P rank (ranges: remote = P's offset, local = D's).
    Empty when no D rank does (D's rank `p_rank % d_tp` then only tells it to free). ValueError
    when a size cannot hold the model's KV heads."""
    if not 0 <= p_rank < p_tp:
        raise ValueError(f"P rank {p_rank} is outside tensor_parallel_size {p_tp}")
    plans = {d_rank: plan_reads(num_kv_heads, p_tp, d_tp, d_rank, head_bytes) for d_rank in range(d_tp)}
    return {d_rank: read for d_rank, plan in plans.items() for read in plan.reads if read.p_rank == p_rank}


def releaser(p_rank: int, d_tp: int) -> int:
    """The D rank that tells P rank `p_rank` to free when no D rank reads from it."""
    return p_rank % d_tp

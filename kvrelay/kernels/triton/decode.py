"""Paged decode attention: one query token per sequence over its whole context, read in place.

Computes, for sequence s and query head h (KV head `h // G`, G = H / H_kv query heads per group):
    out[s, h] = softmax(scale * q[s, h] . K[s, :seq_len]) @ V[s, :seq_len]
where K/V are read through `block_tables[s]` from the paged cache (fp8 widened by its scale).

Grid: (num_seqs, H_kv, num_splits). A program takes one GQA group of one sequence and one
contiguous split of its context: it loads each K/V tile once for all G query heads of the group
(a [G, D] x [D, BLOCK_N] dot, G padded to 16 rows) and keeps an online softmax in float32.
With one split it writes `out` itself; with several (flash-decoding, so a long context keeps
many programs busy) each writes its partial (max, sum, acc) and `_merge_splits_kernel`, grid
(num_seqs, H), combines them. A sequence of length 0 (a padded row of a CUDA-graph replay) reads
no block and gets zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrelay.kernels.triton.layout import (
    check_index,
    check_kv_cache,
    check_rows,
    check_same_device,
    num_query_heads,
)
from kvrelay.kernels.triton.tiles import load_kv_tile, online_softmax_step
from kvrelay.kernels.triton.tiling import decode_tiles
from kvrelay.utils import cdiv

MIN_SPLIT_LEN = 256  # a split shorter than this costs more to merge than it saves
TARGET_PROGRAMS = 512  # enough programs to fill a GPU (an H200 has 132 SMs); revisit per device
MAX_SPLITS = 32


# NOTE: the block-table stride is the step's table width (1 would become a constant) and the
# index tensors are views at step-dependent offsets of one uploaded buffer: neither may pick a
# kernel variant, or eager steps would keep compiling new ones while serving.
@triton.jit(do_not_specialize=["stride_table"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr"])
def _decode_kernel(
    q_ptr, stride_q,  # q [num_seqs, H * D], row stride
    cache_ptr,  # [num_blocks, 2, H_kv, BLOCK_SIZE, HEAD_DIM]
    scales_ptr,  # [2, H_kv] float32 (read only when HAS_SCALES)
    block_tables_ptr, stride_table,  # [num_seqs, max_blocks], row stride
    seq_lens_ptr,  # [num_seqs]
    out_ptr, stride_out,  # out [num_seqs, H * D], row stride (written when NUM_SPLITS == 1)
    part_acc_ptr,  # [num_seqs, H, NUM_SPLITS, HEAD_DIM] float32 (written when NUM_SPLITS > 1)
    part_max_ptr, part_sum_ptr,  # [num_seqs, H, NUM_SPLITS] float32 (likewise)
    scale,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,  # the group's G query heads, padded to a power of two >= 16
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    group = NUM_HEADS // NUM_KV_HEADS  # G, query heads per KV head
    seq_len = tl.load(seq_lens_ptr + seq)
    # This program's positions [start, end): the context cut in NUM_SPLITS runs of whole tiles.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)  # end <= start: an empty split

    g = tl.arange(0, BLOCK_G)  # [BLOCK_G]
    d = tl.arange(0, HEAD_DIM)  # [D]
    heads = kv_head * group + g  # [BLOCK_G], the query heads of this group (and padding rows)
    is_head = tl.broadcast_to(g[:, None] < group, (BLOCK_G, HEAD_DIM))  # [BLOCK_G, D]
    q = tl.load(q_ptr + seq * stride_q + heads[:, None] * HEAD_DIM + d[None, :], mask=is_head,
                other=0.0)  # [BLOCK_G, D]

    row_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq * stride_table  # this sequence's block ids
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        valid = pos < end
        k = load_kv_tile(cache_ptr, scales_ptr, table, pos, valid, 0, kv_head,
                         NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, HAS_SCALES).to(q.dtype)  # [BLOCK_N, D]
        v = load_kv_tile(cache_ptr, scales_ptr, table, pos, valid, 1, kv_head,
                         NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, HAS_SCALES).to(q.dtype)  # [BLOCK_N, D]
        row_max, row_sum, acc = online_softmax_step(q, k, v, valid[None, :], row_max, row_sum, acc,
                                                    scale, DOT_PRECISION)

    if NUM_SPLITS == 1:
        out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]  # [BLOCK_G, D]; zeros if seq_len 0
        tl.store(out_ptr + seq * stride_out + heads[:, None] * HEAD_DIM + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=is_head)
    else:
        part = (seq * NUM_HEADS + heads) * NUM_SPLITS + split  # [BLOCK_G], row of [num_seqs, H, NUM_SPLITS]
        tl.store(part_max_ptr + part, row_max, mask=g < group)
        tl.store(part_sum_ptr + part, row_sum, mask=g < group)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=is_head)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr,  # [num_seqs, H, NUM_SPLITS, HEAD_DIM] float32
    part_max_ptr, part_sum_ptr,  # [num_seqs, H, NUM_SPLITS] float32
    out_ptr, stride_out,  # out [num_seqs, H * D], row stride
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # NUM_SPLITS rounded up to a power of two
):
    seq, head = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    d = tl.arange(0, HEAD_DIM)  # [D]
    part = (seq * NUM_HEADS + head) * NUM_SPLITS + s  # [BLOCK_S]
    is_split = s < NUM_SPLITS
    split_max = tl.load(part_max_ptr + part, mask=is_split, other=float("-inf"))  # [BLOCK_S]
    split_sum = tl.load(part_sum_ptr + part, mask=is_split, other=0.0)  # [BLOCK_S]
    split_rows = tl.broadcast_to(is_split[:, None], (BLOCK_S, HEAD_DIM))  # [BLOCK_S, D]
    split_acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=split_rows,
                        other=0.0)  # [BLOCK_S, D]
    # Rescale every split to the overall max; an empty split (max -inf) weighs 0.
    overall_max = tl.max(split_max, axis=0)
    overall_max = tl.where(overall_max > float("-inf"), overall_max, 0.0)  # all empty: seq_len 0
    weight = tl.exp(split_max - overall_max)  # [BLOCK_S]
    total = tl.sum(weight * split_sum, axis=0)
    out = tl.sum(weight[:, None] * split_acc, axis=0) / tl.where(total > 0, total, 1.0)  # [D]
    tl.store(out_ptr + seq * stride_out + head * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """How many programs share each sequence's context: enough for about TARGET_PROGRAMS in all,
    none shorter than MIN_SPLIT_LEN positions. Host arithmetic only (no device sync), so a
    CUDA-graph capture can fix it for its batch size from the longest context it allows."""
    by_length = cdiv(max_seq_len, MIN_SPLIT_LEN)
    by_occupancy = cdiv(TARGET_PROGRAMS, max(1, num_seqs * num_kv_heads))
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> None:
    """q [num_seqs, H * D] (one query token per sequence; rows may be strided) -> `out` [num_seqs,
    H * D], same dtype. block_tables [num_seqs, max_blocks] and seq_lens [num_seqs], int32 or
    int64, on the cache's device; seq_lens[s] may be 0 (the row's output is zeros). `num_splits`
    defaults to `decode_num_splits` for the longest context the block table can hold."""
    cache = check_kv_cache("paged_decode", kv_cache, kv_scales)
    num_seqs = q.shape[0]
    num_heads = num_query_heads("paged_decode", q, cache)
    check_rows("paged_decode", "q", q, num_seqs, num_heads * cache.head_dim)
    check_rows("paged_decode", "out", out, num_seqs, num_heads * cache.head_dim)
    if out.dtype != q.dtype:
        raise ValueError(f"paged_decode: out must be {q.dtype} like q, got {out.dtype}")
    if block_tables.dim() != 2:
        raise ValueError(f"paged_decode: block_tables must be [num_seqs, max_blocks], got "
                         f"{tuple(block_tables.shape)}")
    check_index("paged_decode", "block_tables", block_tables, (num_seqs, block_tables.shape[1]))
    check_index("paged_decode", "seq_lens", seq_lens, (num_seqs,))
    check_same_device("paged_decode", kv_cache, q=q, out=out, block_tables=block_tables, seq_lens=seq_lens)
    if num_splits is None:
        max_seq_len = block_tables.shape[1] * cache.block_size
        num_splits = decode_num_splits(num_seqs, cache.num_kv_heads, max_seq_len)
    if num_splits < 1:
        raise ValueError(f"paged_decode: num_splits must be >= 1, got {num_splits}")
    if num_seqs == 0:
        return

    part_acc = part_max = part_sum = None
    if num_splits > 1:
        part_acc = q.new_empty(num_seqs, num_heads, num_splits, cache.head_dim, dtype=torch.float32)
        part_max = q.new_empty(num_seqs, num_heads, num_splits, dtype=torch.float32)
        part_sum = q.new_empty(num_seqs, num_heads, num_splits, dtype=torch.float32)
    group = num_heads // cache.num_kv_heads
    tiles = decode_tiles(cache.head_dim, q.dtype)
    _decode_kernel[(num_seqs, cache.num_kv_heads, num_splits)](
        q, q.stride(0), kv_cache, kv_scales, block_tables, block_tables.stride(0), seq_lens,
        out, out.stride(0), part_acc, part_max, part_sum, scale,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=cache.num_kv_heads,
        BLOCK_SIZE=cache.block_size,
        HEAD_DIM=cache.head_dim,
        HAS_SCALES=kv_scales is not None,
        NUM_SPLITS=num_splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=tiles.block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_acc, part_max, part_sum, out, out.stride(0),
            NUM_HEADS=num_heads,
            HEAD_DIM=cache.head_dim,
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=1,
        )

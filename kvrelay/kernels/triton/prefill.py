"""Paged prefill attention: several query tokens per sequence over the whole context in the cache.

The batch is varlen: sequence s owns query rows `query_start_loc[s] .. query_start_loc[s+1]`,
its query_len tokens at positions `seq_len - query_len + i`, and attends causally to positions
0 .. its own, all read in place through `block_tables[s]` (so the new tokens' K/V must already
have been written by `store_kv`). This is the prefill that continues a cached prefix (a prefix
hit, the next chunk of a chunked prefill); with query_len == seq_len it is a plain causal
prefill read from the cache.
    out[t, h] = softmax(scale * q[t, h] . K[s, :pos_t + 1]) @ V[s, :pos_t + 1]

Grid: (query tiles of the longest query, num_seqs, H). A program takes BLOCK_M query rows of
one head and walks the context in tiles of BLOCK_N positions, up to the last position its rows
may see, with an online softmax in float32. Programs past their sequence's queries exit.

`aligned=True` (the batch-invariant mode) cuts the query tiles at multiples of BLOCK_M of the
position instead of at the chunk's first query: the token at position p is then always row
p % BLOCK_M of its tile, whether it is computed in a whole prompt, in a chunk, after a prefix
hit or as a decode row, so a dot whose rounding follows the row's place in the tile (the
interpreter's BLAS does) cannot tell those apart. The key tiles start at position 0 either way.
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
from kvrelay.kernels.triton.tiling import prefill_tiles
from kvrelay.utils import cdiv


# NOTE: as in decode.py, the table stride and the index tensors' offsets change from step to step
# and must not pick a kernel variant.
@triton.jit(do_not_specialize=["stride_table"],
            do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"])
def _prefill_kernel(
    q_ptr, stride_q,  # q [num_tokens, H * D], row stride
    cache_ptr,  # [num_blocks, 2, H_kv, BLOCK_SIZE, HEAD_DIM]
    scales_ptr,  # [2, H_kv] float32 (read only when HAS_SCALES)
    block_tables_ptr, stride_table,  # [num_seqs, max_blocks], row stride
    query_start_loc_ptr,  # [num_seqs + 1]
    seq_lens_ptr,  # [num_seqs]
    out_ptr, stride_out,  # out [num_tokens, H * D], row stride
    scale,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ALIGNED: tl.constexpr,  # query tiles at multiples of BLOCK_M of the position (module docstring)
):
    tile, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
    first_row = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - first_row
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - query_len  # the position of the sequence's first query token
    shift = first_pos % BLOCK_M if ALIGNED else 0  # rows of the first tile before the first query
    if tile * BLOCK_M >= query_len + shift:
        return

    i = tile * BLOCK_M - shift + tl.arange(0, BLOCK_M)  # [BLOCK_M], query index within the sequence
    d = tl.arange(0, HEAD_DIM)  # [D]
    query_pos = first_pos + i  # [BLOCK_M]; rows past query_len sit past seq_len, see everything
    is_query = (i[:, None] >= 0) & (i[:, None] < query_len)  # [BLOCK_M, 1]
    is_query = tl.broadcast_to(is_query, (BLOCK_M, HEAD_DIM))  # [BLOCK_M, D]
    rows = (first_row + i)[:, None] * stride_q + head * HEAD_DIM + d[None, :]  # [BLOCK_M, D]
    q = tl.load(q_ptr + rows, mask=is_query, other=0.0)  # [BLOCK_M, D]

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq * stride_table  # this sequence's block ids
    end = tl.minimum(seq_len, first_pos - shift + (tile + 1) * BLOCK_M)  # past the last position any row sees
    for tile_start in range(0, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        valid = pos < end
        k = load_kv_tile(cache_ptr, scales_ptr, table, pos, valid, 0, kv_head,
                         NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, HAS_SCALES).to(q.dtype)  # [BLOCK_N, D]
        v = load_kv_tile(cache_ptr, scales_ptr, table, pos, valid, 1, kv_head,
                         NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, HAS_SCALES).to(q.dtype)  # [BLOCK_N, D]
        causal = valid[None, :] & (pos[None, :] <= query_pos[:, None])  # [BLOCK_M, BLOCK_N]
        row_max, row_sum, acc = online_softmax_step(q, k, v, causal, row_max, row_sum, acc,
                                                    scale, DOT_PRECISION)

    out = acc / row_sum[:, None]  # [BLOCK_M, D]; every row saw position 0
    out_rows = (first_row + i)[:, None] * stride_out + head * HEAD_DIM + d[None, :]  # [BLOCK_M, D]
    tl.store(out_ptr + out_rows, out.to(out_ptr.dtype.element_ty), mask=is_query)


def paged_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    max_query_len: int,
    kv_scales: torch.Tensor | None = None,
    aligned: bool = False,
) -> None:
    """q [num_tokens, H * D] (rows may be strided) -> `out` [num_tokens, H * D], same dtype.
    Sequence s owns rows query_start_loc[s] .. query_start_loc[s+1] (query_start_loc
    [num_seqs + 1], seq_lens [num_seqs], block_tables [num_seqs, max_blocks], int32 or int64, on
    the cache's device). `max_query_len` (a host int, no device sync) sizes the grid and must be
    at least every sequence's query_len; every query_len must be <= its seq_len. `aligned`: query
    tiles at multiples of BLOCK_M of the position (the batch-invariant mode; module docstring)."""
    cache = check_kv_cache("paged_prefill", kv_cache, kv_scales)
    num_tokens = q.shape[0]
    num_heads = num_query_heads("paged_prefill", q, cache)
    check_rows("paged_prefill", "q", q, num_tokens, num_heads * cache.head_dim)
    check_rows("paged_prefill", "out", out, num_tokens, num_heads * cache.head_dim)
    if out.dtype != q.dtype:
        raise ValueError(f"paged_prefill: out must be {q.dtype} like q, got {out.dtype}")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    check_index("paged_prefill", "seq_lens", seq_lens, (num_seqs,))
    check_index("paged_prefill", "query_start_loc", query_start_loc, (num_seqs + 1,))
    if block_tables.dim() != 2:
        raise ValueError(f"paged_prefill: block_tables must be [num_seqs, max_blocks], got "
                         f"{tuple(block_tables.shape)}")
    check_index("paged_prefill", "block_tables", block_tables, (num_seqs, block_tables.shape[1]))
    check_same_device("paged_prefill", kv_cache, q=q, out=out, block_tables=block_tables,
                      query_start_loc=query_start_loc, seq_lens=seq_lens)
    if max_query_len < 0:
        raise ValueError(f"paged_prefill: max_query_len must be >= 0, got {max_query_len}")
    if num_seqs == 0 or max_query_len == 0:
        return

    tiles = prefill_tiles(cache.head_dim, q.dtype)
    # Aligned, a sequence's queries may start anywhere in their first tile: one tile more.
    num_tiles = (cdiv(max_query_len - 1, tiles.block_m) + 1 if aligned
                 else cdiv(max_query_len, tiles.block_m))
    _prefill_kernel[(num_tiles, num_seqs, num_heads)](
        q, q.stride(0), kv_cache, kv_scales, block_tables, block_tables.stride(0), query_start_loc,
        seq_lens, out, out.stride(0), scale,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=cache.num_kv_heads,
        BLOCK_SIZE=cache.block_size,
        HEAD_DIM=cache.head_dim,
        HAS_SCALES=kv_scales is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        ALIGNED=aligned,
        num_warps=tiles.num_warps,
    )

"""The two device-side building blocks both attention kernels (decode.py, prefill.py) use.

- `load_kv_tile`: K or V of one KV head at a run of context positions, read in place through
  the sequence's block table (no gather copy) and widened in registers (fp8: times its scale).
- `online_softmax_step`: folds one K/V tile into each query row's running (max, sum, acc), so
  a context of any length is attended to in one pass, in float32.

Element offset of position `pos`, K or V `kv`, KV head `h`, dimension `d` in the layer's cache
`[num_blocks, 2, H_kv, block_size, D]` (contiguous):
    block_id * (2 * H_kv * block_size * D) + (kv * H_kv + h) * (block_size * D)
    + (pos % block_size) * D + d,        where block_id = block_table[pos // block_size]
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    cache_ptr,  # [num_blocks, 2, H_kv, BLOCK_SIZE, HEAD_DIM] as stored
    scales_ptr,  # [2, H_kv] float32 (read only when HAS_SCALES)
    block_table_ptr,  # [max_blocks] this sequence's row of the block table
    pos,  # [BLOCK_N] context positions to read
    valid,  # [BLOCK_N] which of them exist; the others read as zeros, from no memory
    kv_index,  # 0: K, 1: V
    kv_head,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_SCALES: tl.constexpr,
):
    """-> [BLOCK_N, HEAD_DIM]: the stored elements, or float32 `stored * scale` when HAS_SCALES."""
    block_ids = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=valid, other=0)  # [BLOCK_N]
    block_ids = block_ids.to(tl.int64)  # a layer's cache may hold more than 2**31 elements
    head_start = (kv_index * NUM_KV_HEADS + kv_head) * (BLOCK_SIZE * HEAD_DIM)  # scalar
    rows = block_ids * (2 * NUM_KV_HEADS * BLOCK_SIZE * HEAD_DIM) + head_start \
        + (pos % BLOCK_SIZE) * HEAD_DIM  # [BLOCK_N], element offset of each position's row
    d = tl.arange(0, HEAD_DIM)  # [D]
    tile = tl.load(cache_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)  # [BLOCK_N, D]
    if HAS_SCALES:
        tile = tile.to(tl.float32) * tl.load(scales_ptr + kv_index * NUM_KV_HEADS + kv_head)
    return tile


@triton.jit
def online_softmax_step(
    q,  # [M, D] query rows, in the compute dtype
    k,  # [N, D] keys, same dtype
    v,  # [N, D] values, same dtype
    visible,  # [M, N] (or broadcastable to it): may row m attend to key n
    row_max,  # [M] float32, the largest score so far (-inf before any)
    row_sum,  # [M] float32, sum of exp(score - row_max) so far
    acc,  # [M, D] float32, sum of exp(score - row_max) * value so far
    scale,  # softmax scale, applied to q . k
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 (exact), "tf32" otherwise (unused by 16-bit dots)
):
    """-> the updated (row_max, row_sum, acc). Each row needs a visible key in its first tile."""
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [M, N] float32
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))  # [M]
    rescale = tl.exp(row_max - new_max)  # [M], 0 on the first tile
    probs = tl.exp(scores - new_max[:, None])  # [M, N]
    row_sum = row_sum * rescale + tl.sum(probs, axis=1)  # [M]
    acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)  # [M, D]
    return new_max, row_sum, acc

"""Write this step's K/V into the paged cache, each token at its slot.

Computes, for every token t with `slot_mapping[t] >= 0` (a slot of -1 is padding: skipped):
    kv_cache[slot // block_size, 0, :, slot % block_size] = quantize(k[t].view(H_kv, D))
    kv_cache[slot // block_size, 1, :, slot % block_size] = quantize(v[t].view(H_kv, D))
where quantize rounds to the cache's dtype: float16 clamps to +-65504 first; fp8 stores
`x / kv_scales[kv, h]` saturated to the format's largest value (448 for e4m3, 57344 for e5m2).

Grid: one program per token, writing all of that token's K and V heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrelay.kernels.triton.layout import (
    FP8_DTYPES,
    check_index,
    check_kv_cache,
    check_rows,
    check_same_device,
)


# NOTE: slot_mapping is a view at a step-dependent offset of the uploaded buffer: its alignment must
# not pick a kernel variant.
@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])
def _store_kv_kernel(
    k_ptr, v_ptr, stride_k, stride_v,  # k, v [T, H_kv * D], row strides
    cache_ptr,  # [num_blocks, 2, H_kv, BLOCK_SIZE, HEAD_DIM]
    slot_mapping_ptr,  # [T] int64
    scales_ptr,  # [2, H_kv] float32 (read only when HAS_SCALES)
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # NUM_KV_HEADS rounded up to a power of two
    HAS_SCALES: tl.constexpr,
    MAX_STORED: tl.constexpr,  # clamp to +-MAX_STORED before rounding (fp8, float16); 0.0: no clamp
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # a padded row of a CUDA-graph replay
        return
    h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    d = tl.arange(0, HEAD_DIM)  # [D]
    is_head = tl.broadcast_to(h[:, None] < NUM_KV_HEADS, (BLOCK_H, HEAD_DIM))  # [BLOCK_H, D]
    row_elems = h[:, None] * HEAD_DIM + d[None, :]  # [BLOCK_H, D], offsets within a row of k or v
    # K of head h at this slot: cache[block, 0, h, offset, :]; its V lies H_kv head rows further.
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    k_dest = cache_ptr + block * (2 * NUM_KV_HEADS * BLOCK_SIZE * HEAD_DIM) + offset * HEAD_DIM \
        + h[:, None] * (BLOCK_SIZE * HEAD_DIM) + d[None, :]  # [BLOCK_H, D] pointers
    v_dest = k_dest + NUM_KV_HEADS * BLOCK_SIZE * HEAD_DIM  # [BLOCK_H, D] pointers
    k_row = tl.load(k_ptr + token * stride_k + row_elems, mask=is_head, other=0.0)  # [BLOCK_H, D]
    v_row = tl.load(v_ptr + token * stride_v + row_elems, mask=is_head, other=0.0)  # [BLOCK_H, D]
    if HAS_SCALES:  # fp8 stores x / its head's scale; scales [2, H_kv]: K's row, then V's
        is_kv_head = h < NUM_KV_HEADS  # [BLOCK_H]
        k_scale = tl.load(scales_ptr + h, mask=is_kv_head, other=1.0)  # [BLOCK_H]
        v_scale = tl.load(scales_ptr + NUM_KV_HEADS + h, mask=is_kv_head, other=1.0)  # [BLOCK_H]
        k_row = k_row.to(tl.float32) / k_scale[:, None]
        v_row = v_row.to(tl.float32) / v_scale[:, None]
    if MAX_STORED > 0:
        k_row = tl.minimum(tl.maximum(k_row, -MAX_STORED), MAX_STORED)
        v_row = tl.minimum(tl.maximum(v_row, -MAX_STORED), MAX_STORED)
    tl.store(k_dest, k_row.to(cache_ptr.dtype.element_ty), mask=is_head)
    tl.store(v_dest, v_row.to(cache_ptr.dtype.element_ty), mask=is_head)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """k, v [T, H_kv * D] (rows may be strided) -> written into `kv_cache` at `slot_mapping[T]`
    (int64; -1 skips the token). fp8 caches need `kv_scales` [2, H_kv] float32."""
    cache = check_kv_cache("store_kv", kv_cache, kv_scales)
    num_tokens = slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1
    check_index("store_kv", "slot_mapping", slot_mapping, (num_tokens,))
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"store_kv: slot_mapping must be int64, got {slot_mapping.dtype}")
    row_width = cache.num_kv_heads * cache.head_dim
    check_rows("store_kv", "k", k, num_tokens, row_width)
    check_rows("store_kv", "v", v, num_tokens, row_width)
    check_same_device("store_kv", kv_cache, k=k, v=v, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    clamps = kv_cache.dtype in FP8_DTYPES or kv_cache.dtype == torch.float16
    _store_kv_kernel[(num_tokens,)](
        k, v, k.stride(0), v.stride(0), kv_cache, slot_mapping, kv_scales,
        NUM_KV_HEADS=cache.num_kv_heads,
        BLOCK_SIZE=cache.block_size,
        HEAD_DIM=cache.head_dim,
        BLOCK_H=triton.next_power_of_2(cache.num_kv_heads),
        HAS_SCALES=kv_scales is not None,
        MAX_STORED=torch.finfo(kv_cache.dtype).max if clamps else 0.0,
        num_warps=1 if row_width <= 512 else 4,
    )

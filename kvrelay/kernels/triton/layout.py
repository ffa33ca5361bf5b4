"""The KV cache contract as the Triton launchers check it, in one place.

One tensor per layer, `kv_cache[num_blocks, 2, H_kv, block_size, head_dim]`, K at index 0 and V
at 1, contiguous. A float32/float16/bfloat16 cache stores the plain rounded values; an fp8 cache
(float8_e4m3fn, float8_e5m2) stores `value / scale`, saturated to the format's range, with
`kv_scales[2, H_kv]` float32 (K's scales, then V's; one per KV head).

Every launcher validates its tensors here on the host (shapes, dtypes, devices) and raises a
ValueError naming the offending value, so a kernel never guesses at a layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, *FP8_DTYPES)
COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what q, k, v and out may hold
INDEX_DTYPES = (torch.int32, torch.int64)  # block tables, sequence lengths, query start offsets


@dataclass(frozen=True)
class CacheShape:
    num_blocks: int
    num_kv_heads: int
    block_size: int
    head_dim: int


def check_kv_cache(kernel: str, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> CacheShape:
    """The cache's dimensions, after checking it (and its scales) against the contract."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(f"{kernel}: kv_cache must be [num_blocks, 2, H_kv, block_size, head_dim], "
                         f"got shape {tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise ValueError(f"{kernel}: kv_cache must be contiguous, got strides {kv_cache.stride()}")
    if kv_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"{kernel}: kv_cache dtype must be one of {CACHE_DTYPES}, got {kv_cache.dtype}")
    num_blocks, _, num_kv_heads, block_size, head_dim = kv_cache.shape
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"{kernel}: head_dim must be a power of two >= 16 (the kernels load a head "
                         f"whole, and tl.dot needs 16), got {head_dim}")
    if kv_cache.dtype in FP8_DTYPES:
        if kv_scales is None:
            raise ValueError(f"{kernel}: an {kv_cache.dtype} cache needs kv_scales [2, H_kv] float32")
        if kv_scales.shape != (2, num_kv_heads) or kv_scales.dtype != torch.float32:
            raise ValueError(f"{kernel}: kv_scales must be [2, {num_kv_heads}] float32, got "
                             f"{tuple(kv_scales.shape)} {kv_scales.dtype}")
        check_same_device(kernel, kv_cache, kv_scales=kv_scales)
        if not kv_scales.is_contiguous():
            raise ValueError(f"{kernel}: kv_scales must be contiguous, got strides {kv_scales.stride()}")
    elif kv_scales is not None:
        raise ValueError(f"{kernel}: kv_scales are for fp8 caches only, got them with a "
                         f"{kv_cache.dtype} cache")
    return CacheShape(num_blocks, num_kv_heads, block_size, head_dim)


def check_rows(kernel: str, name: str, x: torch.Tensor, num_rows: int, row_width: int) -> None:
    """x must be [num_rows, row_width] in a compute dtype, its rows possibly strided, each contiguous."""
    if x.dim() != 2 or x.shape != (num_rows, row_width):
        raise ValueError(f"{kernel}: {name} must be [{num_rows}, {row_width}], got {tuple(x.shape)}")
    if x.dtype not in COMPUTE_DTYPES:
        raise ValueError(f"{kernel}: {name} dtype must be one of {COMPUTE_DTYPES}, got {x.dtype}")
    if x.stride(1) != 1 and num_rows > 0:
        raise ValueError(f"{kernel}: {name} rows must be contiguous (stride 1 within a row), got "
                         f"strides {x.stride()}")


def check_index(kernel: str, name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    """x must be an int32/int64 tensor of `shape` (a 2-D one may have strided rows)."""
    if tuple(x.shape) != shape:
        raise ValueError(f"{kernel}: {name} must have shape {shape}, got {tuple(x.shape)}")
    if x.dtype not in INDEX_DTYPES:
        raise ValueError(f"{kernel}: {name} must be int32 or int64, got {x.dtype}")
    if x.numel() > 0 and x.stride(-1) != 1:
        raise ValueError(f"{kernel}: {name} must be contiguous in its last dimension, got strides "
                         f"{x.stride()}")


def num_query_heads(kernel: str, q: torch.Tensor, cache: CacheShape) -> int:
    """H, from q's row width H * head_dim, checked to be a multiple of H_kv (GQA)."""
    width = q.shape[-1] if q.dim() == 2 else -1
    if width <= 0 or width % cache.head_dim:
        raise ValueError(f"{kernel}: q must be [num_tokens, H * {cache.head_dim}], got {tuple(q.shape)}")
    num_heads = width // cache.head_dim
    if num_heads % cache.num_kv_heads:
        raise ValueError(f"{kernel}: the {num_heads} query heads must be a multiple of the "
                         f"{cache.num_kv_heads} KV heads")
    return num_heads


def check_same_device(kernel: str, kv_cache: torch.Tensor, **others: torch.Tensor) -> None:
    for name, x in others.items():
        if x.device != kv_cache.device:
            raise ValueError(f"{kernel}: {name} is on {x.device}, the KV cache on {kv_cache.device}")

"""Tile sizes and warps of the attention kernels, by head size and compute dtype.

A program keeps its query tile, its float32 accumulator and one K/V tile in registers; past 255
registers a thread spills to local memory, which costs more than a smaller tile. The choices
below are the largest tiles that compiled without a spill for sm_90a (H100/H200), read off the
compiled cubins (`cuobjdump --dump-resource-usage`, Triton 3.9 and its ptxas, no GPU needed to
compile), against the previous one-size choice (64 x 64 tiles, 4 warps everywhere):

    kernel   dtype  D     64 x 64 tiles (decode: 64), 4 warps   now                 registers / stack
    prefill  bf16   128   255 / 392 B                           64 x 64, 8 warps    240 / 0
    prefill  bf16   256   (with 8 warps: 255 / 304 B)           32 x 32, 8 warps    214 / 0
    prefill  fp32   64    32 / 11,088 B                         32 x 32, 8 warps    103 / 0
    prefill  fp32   128   32 / 9,144 B                          32 x 32, 8 warps    181 / 0
    prefill  fp32   256   (32 x 32, 8 warps: 32 / 6,872 B)      16 x 16, 8 warps    132 / 0
    decode   bf16   128   255 / 56 B                            64, 8 warps         177 / 0
    decode   bf16   256   (with 8 warps: 255 / 56 B)            32, 8 warps         172 / 0
    decode   fp32   128   255 / 1,616 B                         32, 8 warps         123 / 0
    decode   fp32   256   not compiled                          16, 8 warps         100 / 0

(No spill either, at 4 warps: 16-bit heads of 64 or less with 64 x 64 tiles (decode 64),
float32 decode at 64 or less with 64, float32 prefill at 32 or less with 32 x 32: 126 registers.)
float32 runs its dots as exact FMA loops ("ieee"), which is what makes its big tiles spill. The
Triton of the device (3.6) may allocate otherwise: the device check runs
tests/kernels/triton/test_tiling.py compiled, which reads the spills of every choice above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tiles:
    block_m: int  # query rows per program (prefill only)
    block_n: int  # context positions per K/V tile
    num_warps: int


def prefill_tiles(head_dim: int, dtype: torch.dtype) -> Tiles:
    """The prefill kernel's tiles for queries of `dtype` and heads of `head_dim`."""
    if dtype == torch.float32:
        if head_dim <= 32:
            return Tiles(32, 32, 4)
        return Tiles(32, 32, 8) if head_dim <= 128 else Tiles(16, 16, 8)
    if head_dim <= 64:
        return Tiles(64, 64, 4)
    return Tiles(64, 64, 8) if head_dim <= 128 else Tiles(32, 32, 8)


def decode_tiles(head_dim: int, dtype: torch.dtype) -> Tiles:
    """The decode kernel's tiles (block_m unused: a program holds one GQA group's query heads)."""
    if head_dim <= 64:
        return Tiles(1, 64, 4)
    if dtype == torch.float32:
        return Tiles(1, 32, 8) if head_dim <= 128 else Tiles(1, 16, 8)
    return Tiles(1, 64, 8) if head_dim <= 128 else Tiles(1, 32, 8)

"""Paged attention: K/V live in fixed-size blocks; each sequence names its blocks in a block table.

One KV tensor per layer, shaped [num_blocks, 2, num_kv_heads, block_size, head_dim]: K at index 0,
V at 1, one block's bytes contiguous and heads outer within a block, so a connector can address a
block (or one head's slice of it) by offset.

The layer owns its cache and the connector's hooks; the work (writing this step's K/V, attending)
is its backend's (kvrelay/attention/backends/): the engine sets one backend on every layer at
start, and the step's metadata in the forward context is that backend's. A layer used on its own
(tests, calibration) takes the reference metadata and the CPU or torch route by its cache's device.

The cache stores its own format (`kv_format`, kvrelay/attention/kv_format.py), whatever the
weights' dtype: K/V are rounded (fp8: scaled and saturated) when written; the native and Triton
kernels read the stored elements directly, the torch route widens what it reads per step.
"""

from __future__ import annotations

import torch
from torch import nn

from kvrelay.attention.backends import AttentionBackend, CpuBackend, TorchBackend
from kvrelay.attention.forward_context import get_forward_context
from kvrelay.attention.kv_format import KVFormat, kv_format
from kvrelay.attention.metadata import (
    AttentionMetadata,
    DecodeBatch,
    PrefillSeq,
    StepBatch,
    build_attention_metadata,
)

__all__ = ["Attention", "AttentionMetadata", "DecodeBatch", "PrefillSeq", "StepBatch",
           "build_attention_metadata"]


class Attention(nn.Module):
    """Attention of this step's queries over each sequence's whole context in the paged cache.

    Calls the connector hooks through the forward context: `wait_for_layer_load` before touching
    the cache, `save_kv_layer` after this step's K/V were written.
    """

    def __init__(
        self, layer_name: str, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ) -> None:
        super().__init__()
        self.layer_name = layer_name
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # [num_blocks, 2, num_kv_heads, block_size, head_dim]; assigned by the model runner,
        # with the format it stores and, for fp8, the scales: [2 (K, V), num_kv_heads] float32.
        self.kv_cache: torch.Tensor = torch.empty(0)
        self.kv_format: KVFormat = kv_format("float32")
        self.kv_scales: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None  # set by the runner; None: by the cache's device

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H*D], k/v [T, Hkv*D] (already roped; row strides may be padded) -> [T, H*D]."""
        ctx = get_forward_context()
        meta = ctx.attn_metadata[self.layer_name]
        ctx.kv_connector.wait_for_layer_load(self.layer_name)
        out = self._backend().forward(self, q, k, v, meta)  # [T, H*D]
        ctx.kv_connector.save_kv_layer(self.layer_name, self.kv_cache, meta)
        return out

    def _backend(self) -> AttentionBackend:
        if self.backend is None:
            self.backend = CpuBackend() if self.kv_cache.device.type == "cpu" else TorchBackend()
        return self.backend

"""The CPU attention route: the torch route with the native kernels where they apply.

The KV write of a float32 cache goes through `elementwise.c` (one pass over the step's tokens);
decode of float32 queries through `paged_decode.c`, which reads each sequence's blocks in place
in any cache format and widens them in registers. Anything the kernels do not take (other
dtypes, a non-contiguous cache, no C compiler) runs the torch route. The kernels trust every
pointer they are given, so the slots and block ids are checked against the cache first.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvrelay.attention.backends.base import PagedLayer
from kvrelay.attention.backends.reference import TorchBackend
from kvrelay.attention.metadata import AttentionMetadata, DecodeBatch
from kvrelay.kernels.native import elementwise_kernels, paged_decode_kernel


class CpuBackend(TorchBackend):
    name: ClassVar[str] = "cpu"

    def write_kv(self, layer: PagedLayer, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        cache = layer.kv_cache
        kernels = elementwise_kernels() if (
            cache.device.type == "cpu" and cache.dtype == torch.float32 and cache.is_contiguous()
            and k.dtype == v.dtype == torch.float32 and k.stride(-1) == v.stride(-1) == 1) else None
        if kernels is None:
            super().write_kv(layer, k, v, meta)
            return
        low, high = meta.slot_range
        if low < 0 or high >= cache.shape[0] * meta.block_size:  # C writes wherever it is told
            raise ValueError(f"{layer.layer_name}: slots {low}..{high} fall outside the KV cache "
                             f"({cache.shape[0]} blocks of {meta.block_size})")
        kernels.write_kv(k, v, cache, meta.slot_mapping)

    def decode(self, layer: PagedLayer, q: torch.Tensor, batch: DecodeBatch,
               meta: AttentionMetadata) -> torch.Tensor:
        cache = layer.kv_cache
        native = q.dtype == torch.float32 and cache.device.type == "cpu" and cache.is_contiguous()
        kernel = paged_decode_kernel() if native else None
        if kernel is None:
            return super().decode(layer, q, batch, meta)
        if not 0 <= batch.max_block_id < cache.shape[0]:  # C reads wherever it is told
            raise ValueError(f"{layer.layer_name}: block id {batch.max_block_id} is outside the KV cache "
                             f"({cache.shape[0]} blocks)")
        queries = q[batch.token_index]  # [n, H*D], a strided view when the rows are consecutive
        if queries.stride(-1) != 1:
            queries = queries.contiguous()
        out = q.new_empty(batch.num_seqs, layer.num_heads * layer.head_dim)  # [n, H*D]
        block_tables = batch.block_ids.view(batch.num_seqs, batch.max_blocks)  # [n, max_blocks]
        kernel(queries, cache, block_tables, batch.seq_lens, out, layer.scale, layer.kv_scales)
        return out

"""The CPU attention route of the batch-invariant mode: every query row through `paged_decode.c`.

Outside the mode a step's decode rows go through the native decode kernel and its prefill rows
through `scaled_dot_product_attention`, whose tiling follows the prompt's length; so the last
prompt token computed in a prefill (on P) and the same token recomputed as a one-token step (on
D, after a transfer) differ in the last bits. Here each query row, prefill or decode, is one row
of the decode kernel: the row at position p attends to positions 0..p of its sequence (its own
K/V written first), read block by block from the start with an online softmax per block. A row's
result then depends only on its query, its position and the K/V before it: not on the step's
other rows, on how its prompt was chunked, or on whether the context came from the prefix cache,
an offload tier or another instance. The kernel's work items are rows (or a row's KV heads),
never a split of one row's context, so the thread count does not change it either.

Measured on the 2-core AMD EPYC (2026-12, 9 heads, 3 KV heads, D 64): a causal prefill of 128 /
512 / 1024 / 2048 tokens took 0.21 / 2.9 / 11.6 / 47 ms per layer this way against 0.26 / 3.3 /
9.3 / 31 ms through scaled_dot_product_attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kvrelay.attention.backends.base import PagedLayer
from kvrelay.attention.backends.cpu import CpuBackend
from kvrelay.attention.metadata import AttentionMetadata, StepBatch
from kvrelay.kernels.native import paged_decode_kernel


@dataclass
class RowsMetadata(AttentionMetadata):
    """A step as one row per query token (the KV write reads the AttentionMetadata fields)."""

    row_tables: torch.Tensor | None = None  # [T, W] int64: each row's sequence's block table
    row_lens: torch.Tensor | None = None  # [T] int64: position + 1, the context each row sees
    max_block_id: int = -1


class RowsCpuBackend(CpuBackend):
    """`cpu` in the batch-invariant mode (see the module docstring)."""

    name: ClassVar[str] = "cpu"

    def __init__(self) -> None:
        if paged_decode_kernel() is None:
            raise ValueError("batch_invariant on the CPU needs the native attention kernel, which is "
                             "unavailable here (KVRELAY_NATIVE_KERNELS=0, or no C compiler: see the log)")

    def build_metadata(self, batch: StepBatch) -> RowsMetadata:
        slots = batch.slot_mapping
        num_tokens = len(slots)
        seq = np.repeat(np.arange(batch.num_seqs), batch.query_lens)  # [T], each row's sequence
        lens = batch.positions + 1  # [T]
        width = max(1, int((batch.seq_lens.max(initial=1) + batch.block_size - 1) // batch.block_size))
        tables = batch.block_tables[seq, :width].astype(np.int64)  # [T, W]
        used = (lens + batch.block_size - 1) // batch.block_size  # [T], blocks each row reads
        # NOTE: past a row's blocks the kernel reads only the next id to prefetch: a real block (its first).
        tables = np.where(np.arange(width)[None, :] >= used[:, None], tables[:, :1], tables)
        device = batch.device
        return RowsMetadata(
            slot_mapping=torch.from_numpy(slots).to(device), query_start_loc=batch.query_start_loc.tolist(),
            seq_lens=batch.seq_lens.tolist(), block_size=batch.block_size, decode=None, prefills=[],
            slot_range=(int(slots.min()), int(slots.max())) if num_tokens else (0, -1),
            row_tables=torch.from_numpy(np.ascontiguousarray(tables)).to(device),
            row_lens=torch.from_numpy(lens.astype(np.int64)).to(device),
            max_block_id=int(tables.max()) if num_tokens else -1)

    def forward(self, layer: PagedLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: RowsMetadata) -> torch.Tensor:  # type: ignore[override]
        self.write_kv(layer, k, v, meta)
        cache = layer.kv_cache
        kernel = paged_decode_kernel()
        if kernel is None or q.dtype != torch.float32 or not cache.is_contiguous():
            raise ValueError(f"{layer.layer_name}: the batch-invariant CPU route needs float32 queries, a "
                             f"contiguous KV cache and the native kernel; got {q.dtype}")
        assert meta.row_tables is not None and meta.row_lens is not None
        if not 0 <= meta.max_block_id < cache.shape[0]:  # C reads wherever it is told
            raise ValueError(f"{layer.layer_name}: block id {meta.max_block_id} is outside the KV cache "
                             f"({cache.shape[0]} blocks)")
        queries = q if q.stride(-1) == 1 else q.contiguous()  # [T, H*D], rows may be strided
        out = q.new_empty(q.shape[0], layer.num_heads * layer.head_dim)  # [T, H*D]
        kernel(queries, cache, meta.row_tables, meta.row_lens, out, layer.scale, layer.kv_scales)
        return out

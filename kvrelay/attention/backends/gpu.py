"""The CUDA attention route: Triton kernels over the paged cache, and the buffers of captured
decode steps.

Per layer and step: `store_kv` writes this step's K/V at their slots; the sequences with one
query token run `paged_decode` (each GQA group's query heads share every K/V load, the context
split across programs for long sequences), the others `paged_prefill`. The runner puts a step's
decodes first (`reorder_batch_threshold`, as vLLM's builders ask), so in a mixed step the decode
rows are the leading rows of every input and each kernel takes a slice, no gather. Both read the
blocks where they lie. Nothing here reads a device value on the host, so a decode step can run
inside a CUDA graph: `graph_inputs` hands out the static buffers such a graph reads, and pads a
smaller batch with rows that write no KV (slot -1) and read no block (length 0).

In the batch-invariant mode (`batch_invariant=True`) every step runs `paged_prefill`, decode rows
included, as a prefill of one query, with its query tiles aligned to positions: a row's
reduction is then the prefill kernel's, its key tiles from position 0 and its place in its query
tile fixed by its position, with one split, whatever the step's mix, batch size or CUDA-graph
padding; the last prompt token computed on P equals the same token recomputed on D. Decode
attention costs more (each query head reads its K/V tiles alone, no context split).

Off a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1), which is how the tests
check this route against the torch one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kvrelay.attention.backends.base import AttentionBackend, GraphInputs, PagedLayer
from kvrelay.attention.metadata import StepBatch


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding
    block_tables: torch.Tensor  # [S, W] int32
    seq_lens: torch.Tensor  # [S] int32, 0 for padding
    query_start_loc: torch.Tensor  # [S + 1] int32
    max_query_len: int
    decode_only: bool
    num_splits: int  # how many programs share one decode sequence's context
    num_decodes: int  # the leading sequences with one query token: paged_decode's rows


class TritonBackend(AttentionBackend):
    name: ClassVar[str] = "triton"
    supports_cuda_graphs: ClassVar[bool] = True
    reorder_batch_threshold: ClassVar[int | None] = 1

    def __init__(self, num_kv_heads: int, max_model_len: int, batch_invariant: bool = False) -> None:
        self.num_kv_heads = num_kv_heads  # this rank's
        self.max_model_len = max_model_len
        self.batch_invariant = batch_invariant

    def num_splits(self, num_seqs: int) -> int:
        """Decode's context split, a function of the batch size alone: a kernel variant per
        split count, so few of them (and a CUDA graph per size fixes its own). One in the
        batch-invariant mode (whose decode rows run the prefill kernel)."""
        from kvrelay.kernels.triton import decode_num_splits

        if self.batch_invariant:
            return 1
        return decode_num_splits(num_seqs, self.num_kv_heads, self.max_model_len)

    def build_metadata(self, batch: StepBatch) -> TritonMetadata:
        inputs = batch.device_inputs()
        num_decodes = batch.num_seqs if batch.is_decode_only else leading_decodes(batch.query_lens)
        return TritonMetadata(inputs.slot_mapping, inputs.block_tables, inputs.seq_lens,
                              inputs.query_start_loc, batch.max_query_len, batch.is_decode_only,
                              self.num_splits(num_decodes), num_decodes)

    def forward(self, layer: PagedLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: TritonMetadata) -> torch.Tensor:
        from kvrelay.kernels.triton import paged_decode, paged_prefill, store_kv

        cache, scales = layer.kv_cache, layer.kv_scales
        store_kv(k, v, cache, meta.slot_mapping, scales)
        out = q.new_empty(q.shape[0], layer.num_heads * layer.head_dim)  # [T, H*D]
        if self.batch_invariant:  # every row a prefill row: one kernel whatever the step's mix
            paged_prefill(q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, out, layer.scale,
                          meta.max_query_len, scales, aligned=True)
            return out
        n = meta.num_decodes  # their query rows are q's first n rows
        if n:
            paged_decode(q[:n], cache, meta.block_tables[:n], meta.seq_lens[:n], out[:n], layer.scale, scales,
                         num_splits=meta.num_splits)
        if not meta.decode_only:  # query_start_loc[n:] holds the prefills' offsets into all of q
            paged_prefill(q, cache, meta.block_tables[n:], meta.query_start_loc[n:], meta.seq_lens[n:], out,
                          layer.scale, meta.max_query_len, scales)
        return out

    def graph_inputs(self, max_num_seqs: int, max_blocks: int, device: torch.device) -> TritonGraphInputs:
        return TritonGraphInputs(self, max_num_seqs, max_blocks, device)


def leading_decodes(query_lens: np.ndarray) -> int:
    """How many leading sequences of a step have one query token (query_lens [S])."""
    others = np.flatnonzero(query_lens != 1)
    return int(others[0]) if len(others) else len(query_lens)


class TritonGraphInputs(GraphInputs):
    """Static decode buffers for up to `max_num_seqs` sequences of up to `max_blocks` blocks;
    every captured size reads a leading slice of them."""

    def __init__(self, backend: TritonBackend, max_num_seqs: int, max_blocks: int,
                 device: torch.device) -> None:
        self.backend = backend
        self.slot_mapping = torch.full((max_num_seqs,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_num_seqs, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=device)

    def metadata_for(self, num_seqs: int) -> TritonMetadata:
        n = num_seqs
        return TritonMetadata(self.slot_mapping[:n], self.block_tables[:n], self.seq_lens[:n],
                              self.query_start_loc[:n + 1], 1, True, self.backend.num_splits(n), n)

    def fill(self, batch: StepBatch, padded_num_seqs: int) -> None:
        inputs, n = batch.device_inputs(), batch.num_seqs
        width = inputs.block_tables.shape[1]
        self.slot_mapping[:n].copy_(inputs.slot_mapping)
        self.slot_mapping[n:padded_num_seqs].fill_(-1)
        self.block_tables[:n, :width].copy_(inputs.block_tables)
        self.seq_lens[:n].copy_(inputs.seq_lens)
        self.seq_lens[n:padded_num_seqs].fill_(0)

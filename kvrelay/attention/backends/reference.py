"""The plain-torch attention route: runs on any device, and is what the others are tested against.

- KV write: index-put at (block, offset) per token, in the cache's format (fp8: scaled and
  saturated).
- Decode: all one-query sequences at once, one KV head at a time: the blocks are gathered into a
  padded copy, then batched matmuls with the padding masked (widened per step when the cache
  holds another format than the queries).
- Prefill: one `scaled_dot_product_attention` per sequence, causal for a fresh prompt, masked
  over the context read back from its blocks after a prefix hit.

NOTE: the decode path reads whole padded blocks and multiplies the masked positions by a zero
probability, so the KV tensors must hold finite values: allocate them with `torch.zeros`.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from kvrelay.attention.backends.base import AttentionBackend, PagedLayer
from kvrelay.attention.kv_format import dequantize_kv, quantize_kv
from kvrelay.attention.metadata import (
    AttentionMetadata,
    DecodeBatch,
    PrefillSeq,
    StepBatch,
    reference_metadata,
)


class TorchBackend(AttentionBackend):
    name: ClassVar[str] = "torch"

    def build_metadata(self, batch: StepBatch) -> AttentionMetadata:
        return reference_metadata(batch)

    def forward(self, layer: PagedLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        self.write_kv(layer, k, v, meta)
        if meta.decode is not None and meta.decode.num_seqs == q.shape[0]:  # a decode-only step
            return self.decode(layer, q, meta.decode, meta)  # [T, H*D]
        out = q.new_empty(q.shape[0], layer.num_heads * layer.head_dim)  # [T, H*D]
        if meta.decode is not None:
            out[meta.decode.token_index] = self.decode(layer, q, meta.decode, meta)
        for seq in meta.prefills:
            out[seq.start : seq.end] = self.prefill(layer, q, k, v, seq)
        return out

    def write_kv(self, layer: PagedLayer, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        num_tokens = k.shape[0]
        blocks, offsets = meta.slot_block_ids, meta.slot_offsets
        scales = layer.kv_scales[:, :, None] if layer.kv_scales is not None else (None, None)  # [2, Hkv, 1]
        # Indexing [blocks, kv, :, offsets] selects [num_tokens, Hkv, D].
        for index, x in ((0, k), (1, v)):
            x = x.view(num_tokens, layer.num_kv_heads, layer.head_dim)  # [T, Hkv, D]
            layer.kv_cache[blocks, index, :, offsets] = quantize_kv(x, layer.kv_format, scales[index])

    def decode(self, layer: PagedLayer, q: torch.Tensor, batch: DecodeBatch,
               meta: AttentionMetadata) -> torch.Tensor:
        """One query per sequence, all sequences at once -> [num_seqs, H*D].

        Works one KV head at a time, and gathers V only after K's scores are done, so each
        gathered tensor (num_seqs * L * D) is read back while it is still in cache."""
        n, hkv, d = batch.num_seqs, layer.num_kv_heads, layer.head_dim
        group = layer.num_heads // hkv
        block_size = meta.block_size
        ctx_len = batch.max_blocks * block_size  # L, padded
        queries = q[batch.token_index].view(n, hkv, group, d)  # [n, Hkv, G, D]
        cache = layer.kv_cache.view(layer.kv_cache.shape[0], 2, hkv, block_size * d)  # [blocks, 2, Hkv, bs*D]
        gathered = meta.scratch((n * batch.max_blocks, block_size * d), cache.dtype)  # [n*nb, bs*D]
        mask = batch.mask_as(q.dtype)  # [n, 1, L]
        out = q.new_empty(n, hkv, group, d)  # [n, Hkv, G, D]
        for h in range(hkv):
            torch.index_select(cache[:, 0, h], 0, batch.block_ids, out=gathered)  # keys
            keys = _widen(layer, gathered, 0, h, q.dtype).view(n, ctx_len, d).transpose(1, 2)  # [n, D, L]
            scores = torch.baddbmm(mask, queries[:, h], keys, alpha=layer.scale)  # [n, G, L]
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # [n, G, L]
            torch.index_select(cache[:, 1, h], 0, batch.block_ids, out=gathered)  # values
            values = _widen(layer, gathered, 1, h, q.dtype).view(n, ctx_len, d)  # [n, L, D]
            out[:, h] = torch.bmm(probs, values)  # [n, G, D]
        return out.view(n, layer.num_heads * d)  # [n, H*D]

    def prefill(self, layer: PagedLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                seq: PrefillSeq) -> torch.Tensor:
        """Several queries of one sequence -> [query_len, H*D]."""
        hkv, d = layer.num_kv_heads, layer.head_dim
        query_len = seq.end - seq.start
        queries = q[seq.start : seq.end].view(query_len, layer.num_heads, d).transpose(0, 1)  # [H, Tq, D]
        if seq.block_ids is None:  # the context is exactly this step's tokens
            keys = k[seq.start : seq.end].view(query_len, hkv, d).transpose(0, 1)  # [Hkv, Tq, D]
            values = v[seq.start : seq.end].view(query_len, hkv, d).transpose(0, 1)  # [Hkv, Tq, D]
            out = F.scaled_dot_product_attention(
                queries[None], keys[None], values[None], is_causal=True, scale=layer.scale, enable_gqa=True
            )  # [1, H, Tq, D]
        else:
            blocks = layer.kv_cache.index_select(0, seq.block_ids)  # [nb, 2, Hkv, bs, D]
            blocks = blocks.permute(1, 2, 0, 3, 4).flatten(2, 3)  # [2, Hkv, nb*bs, D]
            scales = layer.kv_scales[:, :, None, None] if layer.kv_scales is not None else (None, None)
            keys = dequantize_kv(blocks[0, :, : seq.seq_len], q.dtype, scales[0])  # [Hkv, S, D]
            values = dequantize_kv(blocks[1, :, : seq.seq_len], q.dtype, scales[1])  # [Hkv, S, D]
            out = F.scaled_dot_product_attention(
                queries[None], keys[None], values[None], attn_mask=seq.mask, scale=layer.scale,
                enable_gqa=True)  # [1, H, Tq, D]
        return out[0].transpose(0, 1).reshape(query_len, layer.num_heads * d)  # [Tq, H*D]


def _widen(layer: PagedLayer, stored: torch.Tensor, index: int, head: int,
           dtype: torch.dtype) -> torch.Tensor:
    """Gathered K (index 0) or V (1) of one head in `dtype`: itself when already so."""
    if layer.kv_scales is not None:
        return (stored.float() * layer.kv_scales[index, head]).to(dtype)
    return stored if stored.dtype == dtype else stored.to(dtype)

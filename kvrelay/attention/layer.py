"""Paged attention: K/V live in fixed-size blocks; each sequence names its blocks in a block table.

One KV tensor per layer, shaped [num_blocks, 2, num_kv_heads, block_size, head_dim]: K at index 0,
V at 1, one block's bytes contiguous and heads outer within a block, so a connector can address a
block (or one head's slice of it) by offset.

Per step the runner builds one `AttentionMetadata` (shared by every layer) that splits the flat
batch in two kinds of work:
- decodes (one query token): attended to as ONE batch per layer, reading every sequence's blocks
  through a padded block table and masking the padding;
- prefills (several query tokens: a prompt, a chunk of one, or a suffix after a prefix hit): one
  `scaled_dot_product_attention` call each, causal with the query offset `seq_len - query_len`.

The cache stores its own format (`kv_format`, `kvrelay/attention/kv_format.py`), whatever the
weights' dtype: K/V are rounded (fp8: scaled and saturated) when written; the native decode
kernel reads the stored elements directly, the torch routes widen what they read per step.

NOTE: the decode path reads whole padded blocks and multiplies the masked positions by a zero
probability, so the KV tensors must hold finite values: allocate them with `torch.zeros`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.attention.forward_context import get_forward_context
from kvrelay.attention.kv_format import KVFormat, dequantize_kv, kv_format, quantize_kv
from kvrelay.kernels.native import elementwise_kernels, paged_decode_kernel
from kvrelay.utils import cdiv


@dataclass
class DecodeBatch:
    """The sequences with exactly one query token this step, attended to together."""

    token_index: slice | torch.Tensor  # their rows in the flat batch (a slice when consecutive)
    num_seqs: int
    max_blocks: int  # padded block-table width
    block_ids: torch.Tensor  # [num_seqs * max_blocks] int64, padded block tables, row-major
    seq_lens: torch.Tensor  # [num_seqs] int64, context length of each after this step
    max_block_id: int  # the largest id in block_ids (checked against the cache before native reads)
    padded_len: int  # max_blocks * block_size, the context length every sequence is padded to
    _mask_by_dtype: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    def mask_as(self, dtype: torch.dtype) -> torch.Tensor:
        """[num_seqs, 1, padded_len]: 0 on a sequence's context, -inf on its padding. Built on first
        use, once per step: only the torch route needs it, the native kernel reads seq_lens."""
        if dtype not in self._mask_by_dtype:
            key_pos = torch.arange(self.padded_len, device=self.seq_lens.device)  # [L]
            in_context = key_pos[None, :] < self.seq_lens[:, None]  # [num_seqs, L]
            mask = torch.zeros(in_context.shape, dtype=dtype, device=self.seq_lens.device)
            self._mask_by_dtype[dtype] = mask.masked_fill_(~in_context, float("-inf"))[:, None, :]
        return self._mask_by_dtype[dtype]


@dataclass
class PrefillSeq:
    """A sequence with several query tokens this step."""

    start: int  # its rows [start, end) in the flat batch
    end: int
    seq_len: int  # context length after this step
    # When part of the context was cached before this step, attention reads the whole context
    # back from these blocks and needs an explicit mask; a fresh prompt needs neither.
    block_ids: torch.Tensor | None  # [ceil(seq_len / block_size)] int64
    mask: torch.Tensor | None  # [query_len, seq_len] bool, True = may attend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset, per token
    query_start_loc: list[int]  # len num_seqs + 1; seq i owns flat tokens [qsl[i], qsl[i+1])
    seq_lens: list[int]  # context length of seq i after this step
    block_size: int
    slot_block_ids: torch.Tensor  # [num_tokens] int64: slot_mapping // block_size
    slot_offsets: torch.Tensor  # [num_tokens] int64: slot_mapping % block_size
    decode: DecodeBatch | None
    prefills: list[PrefillSeq]
    slot_range: tuple[int, int]  # (min, max) of slot_mapping, (0, -1) if empty; checked before C writes
    # Scratch buffers shared by all layers of this step (filled lazily by the first layer).
    workspace: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = field(
        default_factory=dict, repr=False
    )


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Seq i's query tokens sit at positions seq_lens[i]-query_lens[i] .. seq_lens[i]-1.
    block_tables[i] lists the KV block ids of seq i in order, covering at least
    ceil(seq_lens[i]/block_size) blocks (it may list more). Called once per step by the runner;
    the result is shared by all layers."""
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ValueError(
            f"query_lens, seq_lens and block_tables must have one entry per sequence, got "
            f"{len(query_lens)}, {len(seq_lens)}, {len(block_tables)}"
        )
    query_start_loc = [0]
    slots: list[int] = []
    decode_seqs: list[int] = []
    prefills: list[PrefillSeq] = []
    for i, (query_len, seq_len, table) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
        _check_seq(i, query_len, seq_len, table, block_size)
        start = query_start_loc[-1]
        query_start_loc.append(start + query_len)
        first_pos = seq_len - query_len
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(first_pos, seq_len))
        if query_len == 1:
            decode_seqs.append(i)
        elif query_len > 1:
            prefills.append(_prefill_seq(start, query_len, seq_len, table, block_size, device))

    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    decode = None
    if decode_seqs:
        decode = _decode_batch(decode_seqs, query_start_loc, seq_lens, block_tables, block_size, device)
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=list(seq_lens),
        block_size=block_size,
        slot_block_ids=slot_mapping // block_size,
        slot_offsets=slot_mapping % block_size,
        decode=decode,
        prefills=prefills,
        slot_range=(min(slots), max(slots)) if slots else (0, -1),
    )


def _check_seq(i: int, query_len: int, seq_len: int, table: list[int], block_size: int) -> None:
    if query_len < 0 or seq_len < query_len:
        raise ValueError(f"seq {i}: need 0 <= query_len <= seq_len, got {query_len} and {seq_len}")
    needed = cdiv(seq_len, block_size)
    if len(table) < needed:
        raise ValueError(
            f"seq {i}: block table has {len(table)} blocks but seq_len {seq_len} needs {needed} "
            f"(block_size {block_size})"
        )


def _prefill_seq(
    start: int, query_len: int, seq_len: int, table: list[int], block_size: int, device: torch.device
) -> PrefillSeq:
    if query_len == seq_len:  # nothing cached before: causal attention over this step's k/v
        return PrefillSeq(start, start + query_len, seq_len, None, None)
    num_blocks = cdiv(seq_len, block_size)
    block_ids = torch.tensor(table[:num_blocks], dtype=torch.int64, device=device)
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)  # [query_len]
    key_pos = torch.arange(seq_len, device=device)  # [seq_len]
    mask = key_pos[None, :] <= query_pos[:, None]  # [query_len, seq_len]
    return PrefillSeq(start, start + query_len, seq_len, block_ids, mask)


def _decode_batch(
    seqs: list[int],
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> DecodeBatch:
    lens = [seq_lens[i] for i in seqs]
    max_blocks = cdiv(max(lens), block_size)
    rows = []
    for i, seq_len in zip(seqs, lens, strict=True):
        table = block_tables[i][: cdiv(seq_len, block_size)]
        rows.append(table + [table[0]] * (max_blocks - len(table)))  # pad with a real block
    block_ids = torch.tensor(rows, dtype=torch.int64, device=device).flatten()

    rows_in_batch = [query_start_loc[i] for i in seqs]
    first = rows_in_batch[0]
    token_index: slice | torch.Tensor
    if rows_in_batch == list(range(first, first + len(seqs))):
        token_index = slice(first, first + len(seqs))
    else:
        token_index = torch.tensor(rows_in_batch, dtype=torch.int64, device=device)
    seq_len_tensor = torch.tensor(lens, dtype=torch.int64, device=device)
    max_block_id = max(max(row) for row in rows)
    return DecodeBatch(token_index, len(seqs), max_blocks, block_ids, seq_len_tensor, max_block_id,
                       max_blocks * block_size)


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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H*D], k/v [T, Hkv*D] (already roped; row strides may be padded) -> [T, H*D]."""
        ctx = get_forward_context()
        meta: AttentionMetadata = ctx.attn_metadata[self.layer_name]
        ctx.kv_connector.wait_for_layer_load(self.layer_name)
        self._write_kv(k, v, meta)
        if meta.decode is not None and meta.decode.num_seqs == q.shape[0]:  # a decode-only step
            out = self._decode(q, meta.decode, meta)  # [T, H*D]
        else:
            out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)  # [T, H*D]
            if meta.decode is not None:
                out[meta.decode.token_index] = self._decode(q, meta.decode, meta)
            for seq in meta.prefills:
                out[seq.start : seq.end] = self._prefill(q, k, v, seq)
        ctx.kv_connector.save_kv_layer(self.layer_name, self.kv_cache, meta)
        return out

    def _write_kv(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        num_tokens = k.shape[0]
        cache = self.kv_cache
        kernels = elementwise_kernels() if (
            cache.device.type == "cpu" and cache.dtype == torch.float32 and cache.is_contiguous()
            and k.dtype == v.dtype == torch.float32 and k.stride(-1) == v.stride(-1) == 1) else None
        if kernels is not None:
            low, high = meta.slot_range
            if low < 0 or high >= cache.shape[0] * meta.block_size:  # C writes wherever it is told
                raise ValueError(f"{self.layer_name}: slots {low}..{high} fall outside the KV cache "
                                 f"({cache.shape[0]} blocks of {meta.block_size})")
            kernels.write_kv(k, v, cache, meta.slot_mapping)
            return
        blocks, offsets = meta.slot_block_ids, meta.slot_offsets
        scales = self.kv_scales[:, :, None] if self.kv_scales is not None else (None, None)  # [2, Hkv, 1]
        # Indexing [blocks, kv, :, offsets] selects [num_tokens, Hkv, D].
        for index, x in ((0, k), (1, v)):
            x = x.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
            self.kv_cache[blocks, index, :, offsets] = quantize_kv(x, self.kv_format, scales[index])

    def _decode(self, q: torch.Tensor, batch: DecodeBatch, meta: AttentionMetadata) -> torch.Tensor:
        """One query per sequence, all sequences at once -> [num_seqs, H*D].

        On the CPU with float32 queries, the native kernel reads each sequence's blocks in place; elsewhere
        (or without a C compiler) `_decode_torch`."""
        kernel = self._native_decode() if q.dtype == torch.float32 else None
        if kernel is None:
            return self._decode_torch(q, batch, meta)
        if not 0 <= batch.max_block_id < self.kv_cache.shape[0]:  # C reads wherever it is told
            raise ValueError(f"{self.layer_name}: block id {batch.max_block_id} is outside the KV cache "
                             f"({self.kv_cache.shape[0]} blocks)")
        queries = q[batch.token_index]  # [n, H*D], a strided view when the rows are consecutive
        if queries.stride(-1) != 1:
            queries = queries.contiguous()
        out = q.new_empty(batch.num_seqs, self.num_heads * self.head_dim)  # [n, H*D]
        block_tables = batch.block_ids.view(batch.num_seqs, batch.max_blocks)  # [n, max_blocks]
        kernel(queries, self.kv_cache, block_tables, batch.seq_lens, out, self.scale, self.kv_scales)
        return out

    def _native_decode(self) -> Callable[..., None] | None:
        cache = self.kv_cache
        if cache.device.type != "cpu" or not cache.is_contiguous():
            return None
        return paged_decode_kernel()

    def _decode_torch(self, q: torch.Tensor, batch: DecodeBatch, meta: AttentionMetadata) -> torch.Tensor:
        """The plain-torch decode: gathers the blocks into a padded copy, then batched matmuls.

        Works one KV head at a time, and gathers V only after K's scores are done, so each
        gathered tensor (num_seqs * L * D) is read back while it is still in cache. A cache in
        another format than q is widened (and fp8 scaled) after the gather.
        """
        n, hkv, d = batch.num_seqs, self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        block_size = meta.block_size
        ctx_len = batch.max_blocks * block_size  # L, padded
        queries = q[batch.token_index].view(n, hkv, group, d)  # [n, Hkv, G, D]
        cache = self.kv_cache.view(self.kv_cache.shape[0], 2, hkv, block_size * d)  # [blocks, 2, Hkv, bs*D]
        gathered = _workspace(meta, (n * batch.max_blocks, block_size * d), cache.dtype)  # [n*nb, bs*D]
        mask = batch.mask_as(q.dtype)  # [n, 1, L]
        out = q.new_empty(n, hkv, group, d)  # [n, Hkv, G, D]
        for h in range(hkv):
            torch.index_select(cache[:, 0, h], 0, batch.block_ids, out=gathered)  # keys
            keys = self._widen(gathered, 0, h, q.dtype).view(n, ctx_len, d).transpose(1, 2)  # [n, D, L]
            scores = torch.baddbmm(mask, queries[:, h], keys, alpha=self.scale)  # [n, G, L]
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # [n, G, L]
            torch.index_select(cache[:, 1, h], 0, batch.block_ids, out=gathered)  # values
            values = self._widen(gathered, 1, h, q.dtype).view(n, ctx_len, d)  # [n, L, D]
            out[:, h] = torch.bmm(probs, values)  # [n, G, D]
        return out.view(n, self.num_heads * d)  # [n, H*D]

    def _widen(self, stored: torch.Tensor, index: int, head: int, dtype: torch.dtype) -> torch.Tensor:
        """Gathered K (index 0) or V (1) of one head in `dtype`: itself when already so."""
        if self.kv_scales is not None:
            return (stored.float() * self.kv_scales[index, head]).to(dtype)
        return stored if stored.dtype == dtype else stored.to(dtype)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: PrefillSeq) -> torch.Tensor:
        """Several queries of one sequence -> [query_len, H*D]."""
        hkv, d = self.num_kv_heads, self.head_dim
        query_len = seq.end - seq.start
        queries = q[seq.start : seq.end].view(query_len, self.num_heads, d).transpose(0, 1)  # [H, Tq, D]
        if seq.block_ids is None:  # the context is exactly this step's tokens
            keys = k[seq.start : seq.end].view(query_len, hkv, d).transpose(0, 1)  # [Hkv, Tq, D]
            values = v[seq.start : seq.end].view(query_len, hkv, d).transpose(0, 1)  # [Hkv, Tq, D]
            out = F.scaled_dot_product_attention(
                queries[None], keys[None], values[None], is_causal=True, scale=self.scale, enable_gqa=True
            )  # [1, H, Tq, D]
        else:
            blocks = self.kv_cache.index_select(0, seq.block_ids)  # [nb, 2, Hkv, bs, D]
            blocks = blocks.permute(1, 2, 0, 3, 4).flatten(2, 3)  # [2, Hkv, nb*bs, D]
            scales = self.kv_scales[:, :, None, None] if self.kv_scales is not None else (None, None)
            keys = dequantize_kv(blocks[0, :, : seq.seq_len], q.dtype, scales[0])  # [Hkv, S, D]
            values = dequantize_kv(blocks[1, :, : seq.seq_len], q.dtype, scales[1])  # [Hkv, S, D]
            out = F.scaled_dot_product_attention(
                queries[None], keys[None], values[None], attn_mask=seq.mask, scale=self.scale, enable_gqa=True
            )  # [1, H, Tq, D]
        return out[0].transpose(0, 1).reshape(query_len, self.num_heads * d)  # [Tq, H*D]


def _workspace(meta: AttentionMetadata, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A scratch tensor reused by every layer of this step (layers run one after another)."""
    key = (shape, dtype)
    buf = meta.workspace.get(key)
    if buf is None:
        buf = torch.empty(shape, dtype=dtype, device=meta.slot_mapping.device)
        meta.workspace[key] = buf
    return buf

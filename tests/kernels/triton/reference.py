"""Plain-torch references for the Triton kernels, and builders of paged caches to test them on.

The semantics are those of the torch attention route (quantize_kv / dequantize_kv and the
layer's write, decode and prefill), restated here in a few lines so these tests depend on the
KV cache contract, not on where the layer lives.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """x [..., H_kv, D] -> the stored values: fp8 x / scale ([H_kv, 1]) saturated to the format's
    largest value; float16 clamped to +-65504 then rounded; other dtypes rounded."""
    limit = torch.finfo(cache_dtype).max
    if cache_dtype in FP8_DTYPES:
        assert scale is not None
        return (x.float() / scale).clamp(-limit, limit).to(cache_dtype)
    if cache_dtype == torch.float16:
        return x.clamp(-limit, limit).to(cache_dtype)
    return x.to(cache_dtype)


def store_kv_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       kv_scales: torch.Tensor | None) -> torch.Tensor:
    """A copy of kv_cache with k, v [T, H_kv * D] written at their slots (slot -1 skipped)."""
    cache = kv_cache.clone()
    _, _, num_kv_heads, block_size, head_dim = cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size  # [T']
    for index, x in ((0, k), (1, v)):
        x = x[keep].view(-1, num_kv_heads, head_dim)  # [T', H_kv, D]
        scale = kv_scales[index][:, None] if kv_scales is not None else None  # [H_kv, 1]
        cache[blocks, index, :, offsets] = quantize(x, cache.dtype, scale)  # selects [T', H_kv, D]
    return cache


def context_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
               kv_scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V, each [H_kv, seq_len, D] float32, widened (fp8: times its scale)."""
    num_blocks = -(-seq_len // kv_cache.shape[3])
    blocks = kv_cache[block_table[:num_blocks].long()].float()  # [nb, 2, H_kv, bs, D]
    blocks = blocks.permute(1, 2, 0, 3, 4).flatten(2, 3)[:, :, :seq_len]  # [2, H_kv, seq_len, D]
    if kv_scales is not None:
        blocks = blocks * kv_scales[:, :, None, None]  # [2, H_kv, 1, 1]
    return blocks[0], blocks[1]


def attention_reference(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_lens: list[int], seq_lens: list[int], scale: float,
                        kv_scales: torch.Tensor | None) -> torch.Tensor:
    """q [num_tokens, H * D], the sequences' query rows one after another -> [num_tokens, H * D]
    float32. Query i of a sequence sits at position seq_len - query_len + i and attends causally;
    a sequence of length 0 (with one query row, a padded decode row) gets zeros."""
    head_dim, num_kv_heads = kv_cache.shape[4], kv_cache.shape[2]
    num_heads = q.shape[1] // head_dim
    out = torch.zeros(q.shape[0], q.shape[1])
    start = 0
    for s, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        rows = slice(start, start + query_len)
        start += query_len
        if seq_len == 0:
            continue
        k, v = context_kv(kv_cache, block_tables[s], seq_len, kv_scales)  # [H_kv, S, D]
        queries = q[rows].float().view(query_len, num_heads, head_dim).transpose(0, 1)  # [H, Tq, D]
        query_pos = torch.arange(seq_len - query_len, seq_len)  # [Tq]
        visible = torch.arange(seq_len)[None, :] <= query_pos[:, None]  # [Tq, S]
        group = num_heads // num_kv_heads
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [H, S, D]
        scores = scale * queries @ k.transpose(1, 2)  # [H, Tq, S]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)  # [H, Tq, S]
        out[rows] = (probs @ v).transpose(0, 1).reshape(query_len, num_heads * head_dim)  # [Tq, H*D]
    return out


def random_cache(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A cache [num_blocks, 2, H_kv, block_size, D] of `dtype` holding quantized N(0, 1) values,
    and its fp8 scales [2, H_kv] (powers of two, as calibration picks them) or None."""
    values = torch.randn(num_blocks, 2, num_kv_heads, block_size, head_dim, generator=generator)
    if dtype not in FP8_DTYPES:
        return values.to(dtype), None
    scales = 2.0 ** torch.randint(-3, 1, (2, num_kv_heads), generator=generator).float()  # [2, H_kv]
    stored = (values / scales[None, :, :, None, None]).to(dtype)
    return stored, scales


def poison_unused(kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: list[int],
                  spare_blocks: list[int]) -> None:
    """NaN in every position no context covers: the spare blocks, and each sequence's last block
    past its seq_len. A kernel that reads one (even to multiply it by a zero probability) shows
    it as NaN in its output."""
    block_size = kv_cache.shape[3]
    kv_cache[spare_blocks] = float("nan")
    for table, seq_len in zip(block_tables.tolist(), seq_lens, strict=True):
        if seq_len % block_size:
            kv_cache[table[seq_len // block_size], :, :, seq_len % block_size :] = float("nan")


def paged_tables(seq_lens: list[int], block_size: int, num_blocks: int, width: int,
                 generator: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """Block tables [num_seqs, width] int32 naming distinct blocks in shuffled order, padded
    with the id of a spare block (never part of a context), and the spare blocks' ids."""
    needed = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(num_blocks, generator=generator).tolist()
    assert sum(needed) < num_blocks, "the test needs at least one spare block"
    tables, used = [], 0
    for n in needed:
        tables.append(order[used : used + n])
        used += n
    spare = order[used:]
    rows = [table + [spare[0]] * (width - len(table)) for table in tables]
    return torch.tensor(rows, dtype=torch.int32), spare


# Where and how closely the kernels are checked.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # atol and rtol, by q's dtype
INTERPRETED = not torch.cuda.is_available()
NO_BF16_REASON = "bfloat16 runs on a GPU only: the Triton interpreter has no real bfloat16 (it truncates)"

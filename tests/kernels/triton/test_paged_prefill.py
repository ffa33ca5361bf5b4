"""paged_prefill: varlen queries over a cached prefix equal plain-torch causal attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed (pip install triton, or the test extra)")

from kvrelay.kernels.triton import paged_prefill, store_kv  # noqa: E402
from tests.kernels.triton.reference import (  # noqa: E402
    DEVICE,
    INTERPRETED,
    NO_BF16_REASON,
    TOLERANCE,
    attention_reference,
    paged_tables,
    poison_unused,
    random_cache,
)

BLOCK_SIZE, SCALE = 16, 0.125
# (query_len, seq_len) per sequence: a fresh prompt over two query tiles (the kernel's BLOCK_M is
# 64), a prefix hit, a prefix hit whose queries span two tiles, a single query after a prefix.
MIXED_BATCH = [(70, 70), (5, 37), (80, 150), (1, 20)]


def prefill_case(batch: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                 cache_dtype: torch.dtype, q_dtype: torch.dtype, seed: int = 0,
                 aligned: bool = False) -> None:
    """Build a shuffled paged cache whose unused positions hold NaN, run paged_prefill with q
    rows strided (a view of a fused qkv tensor), and compare with the reference."""
    g = torch.Generator().manual_seed(seed)
    query_lens = [query_len for query_len, _ in batch]
    seq_lens = [seq_len for _, seq_len in batch]
    width = max(-(-n // BLOCK_SIZE) for n in seq_lens) + 1
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in seq_lens) + 2
    cache, scales = random_cache(num_blocks, num_kv_heads, BLOCK_SIZE, head_dim, cache_dtype, g)
    tables, spare = paged_tables(seq_lens, BLOCK_SIZE, num_blocks, width, g)
    poison_unused(cache, tables, seq_lens, spare)
    qkv_width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(sum(query_lens), qkv_width, generator=g).to(DEVICE, q_dtype)  # [num_tokens, qkv_width]
    q = qkv[:, : num_heads * head_dim]  # [num_tokens, H * D], rows strided
    query_start_loc = torch.tensor([0] + query_lens).cumsum(0)  # [num_seqs + 1]

    expected = attention_reference(q.cpu(), cache, tables, query_lens, seq_lens, SCALE, scales)
    out = torch.empty(q.shape, dtype=q_dtype, device=DEVICE)
    paged_prefill(q, cache.to(DEVICE), tables.to(DEVICE), query_start_loc.to(DEVICE),
                  torch.tensor(seq_lens, device=DEVICE), out, SCALE, max(query_lens),
                  None if scales is None else scales.to(DEVICE), aligned=aligned)
    tol = TOLERANCE[q_dtype]
    torch.testing.assert_close(out.cpu().float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (2, 2)])
def test_paged_prefill_with_and_without_a_prefix_hit_matches_torch_reference(dtype, num_heads, num_kv_heads):
    prefill_case(MIXED_BATCH, num_heads, num_kv_heads, 32, dtype, dtype)


def test_paged_prefill_with_query_tiles_aligned_to_positions_matches_torch_reference():
    # The batch-invariant mode's tiling: queries starting mid-tile (37 - 5 = 32, 150 - 80 = 70,
    # 20 - 1 = 19) spill into one more tile than their length needs.
    prefill_case(MIXED_BATCH + [(64, 127)], 4, 2, 32, torch.float32, torch.float32, seed=4, aligned=True)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_paged_prefill_widens_an_fp8_cache_by_each_head_scale(cache_dtype):
    prefill_case([(12, 40), (9, 9)], 4, 2, 64, cache_dtype, torch.float16, seed=1)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason=NO_BF16_REASON)
def test_paged_prefill_bfloat16_matches_torch_reference():
    prefill_case(MIXED_BATCH + [(200, 530)], 8, 2, 128, torch.bfloat16, torch.bfloat16, seed=2)


def test_store_kv_then_paged_prefill_of_a_fresh_prompt_equals_causal_attention_over_its_tokens():
    """The engine's order: a step's K/V go into the cache first, then attention reads them back."""
    g = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads, head_dim, prompt_len = 4, 2, 32, 40
    q = torch.randn(prompt_len, num_heads * head_dim, generator=g)
    k = torch.randn(prompt_len, num_kv_heads * head_dim, generator=g)
    v = torch.randn(prompt_len, num_kv_heads * head_dim, generator=g)
    block_table = [5, 2, 7]  # 40 positions over three blocks, out of order
    slots = torch.tensor([block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                          for p in range(prompt_len)])  # [T] int64

    cache = torch.zeros(8, 2, num_kv_heads, BLOCK_SIZE, head_dim, device=DEVICE)
    store_kv(k.to(DEVICE), v.to(DEVICE), cache, slots.to(DEVICE))
    out = torch.empty(q.shape, device=DEVICE)
    paged_prefill(q.to(DEVICE), cache, torch.tensor([block_table], device=DEVICE),
                  torch.tensor([0, prompt_len], device=DEVICE), torch.tensor([prompt_len], device=DEVICE),
                  out, SCALE, prompt_len)

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.view(prompt_len, -1, head_dim).transpose(0, 1)[None]  # [1, heads, T, D]

    expected = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True, scale=SCALE,
                                              enable_gqa=True)  # [1, H, T, D]
    expected = expected[0].transpose(0, 1).reshape(prompt_len, num_heads * head_dim)  # [T, H*D]
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_paged_prefill_refuses_query_start_loc_of_the_wrong_length():
    cache = torch.zeros(4, 2, 2, BLOCK_SIZE, 32)
    q = torch.zeros(3, 64)
    with pytest.raises(ValueError, match=r"query_start_loc must have shape \(2,\), got \(3,\)"):
        paged_prefill(q, cache, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1, 3]),
                      torch.tensor([3]), torch.empty_like(q), SCALE, 3)

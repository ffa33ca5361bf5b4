"""paged_decode: one query per sequence over its paged context equals plain-torch attention."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton, or the test extra)")

from kvrelay.kernels.triton import decode_num_splits, paged_decode  # noqa: E402
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


def decode_case(seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                cache_dtype: torch.dtype, q_dtype: torch.dtype, num_splits: int | None,
                table_dtype: torch.dtype = torch.int32, seed: int = 0) -> None:
    """Build a shuffled paged cache whose unused positions hold NaN, run paged_decode with q
    rows strided (a view of a fused qkv tensor), and compare with the reference."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // BLOCK_SIZE) for n in seq_lens) + 2  # tables padded past the longest context
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in seq_lens) + 3
    cache, scales = random_cache(num_blocks, num_kv_heads, BLOCK_SIZE, head_dim, cache_dtype, g)
    tables, spare = paged_tables(seq_lens, BLOCK_SIZE, num_blocks, width, g)
    poison_unused(cache, tables, seq_lens, spare)
    qkv_width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(len(seq_lens), qkv_width, generator=g).to(DEVICE, q_dtype)  # [num_seqs, qkv_width]
    q = qkv[:, : num_heads * head_dim]  # [num_seqs, H * D], rows strided

    expected = attention_reference(q.cpu(), cache, tables, [1] * len(seq_lens), seq_lens, SCALE, scales)
    out = torch.empty(q.shape, dtype=q_dtype, device=DEVICE)
    paged_decode(q, cache.to(DEVICE), tables.to(DEVICE, table_dtype),
                 torch.tensor(seq_lens, device=DEVICE), out, SCALE,
                 None if scales is None else scales.to(DEVICE), num_splits=num_splits)
    tol = TOLERANCE[q_dtype]
    torch.testing.assert_close(out.cpu().float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (2, 2)])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_paged_decode_matches_torch_reference_on_shuffled_blocks_and_partial_last_blocks(
        dtype, num_heads, num_kv_heads, head_dim):
    decode_case([1, 16, 37, 70], num_heads, num_kv_heads, head_dim, dtype, dtype, num_splits=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [3, 8])
def test_paged_decode_gqa_group_matches_torch_reference_across_context_splits(dtype, num_splits):
    """Contexts of 1 to 300 positions in 3 or 8 splits: some splits hold several tiles, some
    (of the short contexts) none, and the merge must weigh each by its own max."""
    decode_case([300, 1, 129, 64], 4, 2, 64, dtype, dtype, num_splits=num_splits, seed=1)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_paged_decode_seq_len_zero_row_gives_zeros_and_reads_no_block(num_splits, table_dtype):
    """A padded row of a CUDA-graph replay: its table names only a NaN-filled spare block."""
    decode_case([45, 0, 200, 0], 4, 2, 32, torch.float32, torch.float32, num_splits, table_dtype, seed=2)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16])
def test_paged_decode_widens_an_fp8_cache_by_each_head_scale(cache_dtype, q_dtype):
    decode_case([23, 90, 5], 4, 2, 64, cache_dtype, q_dtype, num_splits=2, seed=3)


def test_paged_decode_float16_cache_serves_float32_queries():
    decode_case([33, 17], 2, 1, 32, torch.float16, torch.float32, num_splits=None, seed=4)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason=NO_BF16_REASON)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_paged_decode_bfloat16_matches_torch_reference(num_splits):
    decode_case([1, 300, 129, 0], 8, 2, 128, torch.bfloat16, torch.bfloat16, num_splits, seed=5)


def test_decode_num_splits_splits_long_contexts_only_when_the_batch_leaves_the_gpu_idle():
    assert decode_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=100) == 1  # too short to split
    assert decode_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=8192) == 32
    assert decode_num_splits(num_seqs=64, num_kv_heads=8, max_seq_len=8192) == 1  # 512 programs already
    assert decode_num_splits(num_seqs=0, num_kv_heads=8, max_seq_len=0) == 1


def test_paged_decode_refuses_a_head_dim_that_is_not_a_power_of_two():
    cache = torch.zeros(4, 2, 1, BLOCK_SIZE, 80)
    q = torch.zeros(1, 80)
    with pytest.raises(ValueError, match="head_dim must be a power of two >= 16.*got 80"):
        paged_decode(q, cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                     torch.empty_like(q), SCALE)


def test_paged_decode_refuses_query_heads_that_do_not_split_into_kv_groups():
    cache = torch.zeros(4, 2, 2, BLOCK_SIZE, 32)
    q = torch.zeros(1, 3 * 32)
    with pytest.raises(ValueError, match="the 3 query heads must be a multiple of the 2 KV heads"):
        paged_decode(q, cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                     torch.empty_like(q), SCALE)

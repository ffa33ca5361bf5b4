"""store_kv: each token's K/V lands at its slot, quantized to the cache's format; padding is skipped."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton, or the test extra)")

from kvrelay.kernels.triton import store_kv  # noqa: E402
from tests.kernels.triton.reference import (  # noqa: E402
    DEVICE,
    INTERPRETED,
    NO_BF16_REASON,
    random_cache,
    store_kv_reference,
)

NUM_BLOCKS, BLOCK_SIZE = 8, 16


def fused_kv(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             generator: torch.Generator, magnitude: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [T, H_kv * D] on DEVICE as strided column views of one [T, 3 * H_kv * D] tensor (as a
    fused qkv projection leaves them)."""
    width = num_kv_heads * head_dim
    qkv = (magnitude * torch.randn(num_tokens, 3 * width, generator=generator)).to(DEVICE, dtype)
    return qkv[:, width : 2 * width], qkv[:, 2 * width :]


def run_store(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: list[int],
              scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the cache store_kv leaves, the cache the reference leaves), both on the CPU."""
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    expected = store_kv_reference(k.cpu(), v.cpu(), cache, slot_mapping, scales)
    device_cache = cache.to(DEVICE)
    store_kv(k, v, device_cache, slot_mapping.to(DEVICE),
             None if scales is None else scales.to(DEVICE))
    return device_cache.cpu(), expected


@pytest.mark.parametrize("cache_dtype, input_dtype", [(torch.float32, torch.float32),
                                                      (torch.float16, torch.float16),
                                                      (torch.float16, torch.float32)])
@pytest.mark.parametrize("num_kv_heads, head_dim", [(2, 64), (3, 32)])
def test_store_kv_writes_each_token_at_its_slot_and_nothing_else(cache_dtype, input_dtype, num_kv_heads,
                                                                 head_dim):
    g = torch.Generator().manual_seed(1)
    cache, _ = random_cache(NUM_BLOCKS, num_kv_heads, BLOCK_SIZE, head_dim, cache_dtype, g)
    k, v = fused_kv(6, num_kv_heads, head_dim, input_dtype, g)
    slots = [5 * BLOCK_SIZE + 3, -1, 0, 2 * BLOCK_SIZE + 15, NUM_BLOCKS * BLOCK_SIZE - 1, 5 * BLOCK_SIZE + 4]
    written, expected = run_store(k, v, cache, slots, None)
    assert torch.equal(written, expected)


def test_store_kv_padding_slots_write_nothing():
    g = torch.Generator().manual_seed(2)
    cache, _ = random_cache(NUM_BLOCKS, 2, BLOCK_SIZE, 32, torch.float32, g)
    k, v = fused_kv(4, 2, 32, torch.float32, g)
    written, _ = run_store(k, v, cache, [-1] * 4, None)
    assert torch.equal(written, cache)


def test_store_kv_float16_cache_clamps_to_65504_instead_of_overflowing_to_inf():
    g = torch.Generator().manual_seed(3)
    cache, _ = random_cache(NUM_BLOCKS, 2, BLOCK_SIZE, 32, torch.float16, g)
    k, v = fused_kv(3, 2, 32, torch.float32, g, magnitude=1e5)
    written, expected = run_store(k, v, cache, [1, 40, 77], None)
    assert torch.isfinite(written).all()
    assert written.abs().max() == 65504
    assert torch.equal(written, expected)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_store_kv_fp8_cache_stores_value_over_its_head_scale_saturated_to_the_format_max(cache_dtype):
    """Inputs are fp8 values times their head's scale, plus out-of-range ones: exact to store
    (so this holds in the interpreter too; rounding is the next test's)."""
    g = torch.Generator().manual_seed(4)
    num_kv_heads, head_dim, num_tokens = 2, 32, 5
    cache, scales = random_cache(NUM_BLOCKS, num_kv_heads, BLOCK_SIZE, head_dim, cache_dtype, g)
    assert scales is not None
    stored = (8 * torch.randn(2, num_tokens, num_kv_heads, head_dim, generator=g)).to(cache_dtype).float()
    stored[:, 0, 0, :4] = torch.tensor([1e6, -1e6, 3e5, -3e5])  # beyond both formats' ranges
    k, v = (stored * scales[:, None, :, None]).flatten(2).to(DEVICE)  # [2, T, H_kv * D] -> [T, H_kv * D] each
    written, expected = run_store(k, v, cache, [3, 20, -1, 63, 100], scales)
    assert written.float().abs().max() == torch.finfo(cache_dtype).max
    assert torch.equal(written.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.skipif(INTERPRETED, reason="the Triton interpreter rounds float32 -> fp8 without carrying into "
                    "the exponent (7.94 becomes 4.0 in e4m3; triton-lang/triton#8322): fp8 rounding is "
                    "checked on a GPU")
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_store_kv_fp8_cache_rounds_to_nearest_like_torch(cache_dtype):
    """bf16 inputs over power-of-two scales: exact in float16 too, so a backend that converts
    float32 -> float16 -> fp8 rounds once, like torch."""
    g = torch.Generator().manual_seed(5)
    cache, scales = random_cache(NUM_BLOCKS, 2, BLOCK_SIZE, 64, cache_dtype, g)
    k, v = fused_kv(8, 2, 64, torch.bfloat16, g, magnitude=20.0)
    written, expected = run_store(k, v, cache, list(range(0, 80, 10)), scales)
    assert torch.equal(written.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason=NO_BF16_REASON)
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float32])
def test_store_kv_bfloat16_cache_rounds_like_torch(input_dtype):
    g = torch.Generator().manual_seed(6)
    cache, _ = random_cache(NUM_BLOCKS, 2, BLOCK_SIZE, 64, torch.bfloat16, g)
    k, v = fused_kv(8, 2, 64, input_dtype, g)
    written, expected = run_store(k, v, cache, [7, -1, 30, 31, 32, 90, 100, 127], None)
    assert torch.equal(written, expected)


def test_store_kv_refuses_an_fp8_cache_without_scales():
    cache = torch.zeros(NUM_BLOCKS, 2, 2, BLOCK_SIZE, 32, dtype=torch.float8_e4m3fn)
    k = v = torch.zeros(1, 64)
    with pytest.raises(ValueError, match="needs kv_scales"):
        store_kv(k, v, cache, torch.zeros(1, dtype=torch.int64))


def test_store_kv_refuses_rows_of_the_wrong_width_naming_it():
    cache = torch.zeros(NUM_BLOCKS, 2, 2, BLOCK_SIZE, 32)
    with pytest.raises(ValueError, match=r"k must be \[1, 64\], got \(1, 96\)"):
        store_kv(torch.zeros(1, 96), torch.zeros(1, 64), cache, torch.zeros(1, dtype=torch.int64))


def test_store_kv_refuses_int32_slots():
    cache = torch.zeros(NUM_BLOCKS, 2, 2, BLOCK_SIZE, 32)
    with pytest.raises(ValueError, match="slot_mapping must be int64, got torch.int32"):
        store_kv(torch.zeros(1, 64), torch.zeros(1, 64), cache, torch.zeros(1, dtype=torch.int32))

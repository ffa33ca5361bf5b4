"""KV cache formats: decode attention in every format, native (every build target) and torch routes.

Two comparisons per format:
- against attention over the stored values widened exactly (what the format holds): the native
  kernel and the torch route must match it to float32 round-off (2e-5), i.e. reading the narrow
  elements in place loses nothing beyond the format itself;
- against float32 KV (the values before they were stored): the format's own error, within a
  tolerance stated per format below (inputs ~N(0, 1), outputs are averages of V rows).
"""

from __future__ import annotations

import pytest
import torch

from kvrelay.attention.forward_context import ForwardContext, set_forward_context
from kvrelay.attention.kv_format import dequantize_kv, kv_format, quantize_kv, resolve_kv_format
from kvrelay.attention.layer import Attention, build_attention_metadata
from kvrelay.config import CacheConfig
from kvrelay.kernels import native
from kvrelay.utils import cdiv
from kvrelay.worker.kv_calibration import scales_from_amax
from tests.attention.test_layer import reference_attention
from tests.kernels.builds import ARCHS, require_kernel

# Largest |output - output with float32 KV|, relative to the largest |output with float32 KV|,
# per format: about the format's relative rounding (bf16 2^-9, fp16 2^-12, e4m3 2^-4, e5m2 2^-3),
# since an output is an average of V rows. Measured here: bf16 0.0038, fp16 0.0009, e4m3 0.079,
# e5m2 0.14 (the worst of the three head shapes below).
TOLERANCE_VS_FP32 = {"float32": 1e-6, "bfloat16": 1e-2, "float16": 2e-3, "fp8_e4m3": 0.1, "fp8_e5m2": 0.2}
FORMATS = list(TOLERANCE_VS_FP32)


def store(cache: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An fp32 cache [N, 2, Hkv, bs, D] -> (its stored form, fp8 scales [2, Hkv] or None)."""
    fmt = kv_format(name)
    scales = scales_from_amax(cache.abs().amax(dim=(0, 3, 4)), fmt) if fmt.is_fp8 else None  # [2, Hkv]
    stored = torch.empty(cache.shape, dtype=fmt.torch_dtype)
    for index in (0, 1):
        scale = None if scales is None else scales[index][:, None, None]  # [Hkv, 1, 1]
        stored[:, index] = quantize_kv(cache[:, index], fmt, scale)
    return stored, scales


def widen(stored: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """The exact float32 values a stored cache represents."""
    out = torch.empty(stored.shape, dtype=torch.float32)
    for index in (0, 1):
        out[:, index] = dequantize_kv(stored[:, index], torch.float32,
                                      None if scales is None else scales[index][:, None, None])
    return out


def decode_step(name: str, num_heads: int, num_kv_heads: int, head_dim: int, lens: list[int],
                block_size: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step of an Attention layer whose cache is in format `name`, blocks shuffled.
    Returns (output, reference over the stored values, reference over the float32 values)."""
    torch.manual_seed(3)
    counts = [cdiv(n, block_size) for n in lens]
    perm = torch.randperm(sum(counts) + 3).tolist()
    tables = [perm[sum(counts[:i]): sum(counts[: i + 1])] for i in range(len(lens))]
    fp32_cache = torch.randn(len(perm), 2, num_kv_heads, block_size, head_dim)  # [N, 2, Hkv, bs, D]
    fp32_cache *= torch.linspace(0.5, 2.0, num_kv_heads)[None, None, :, None, None]  # heads differ in range
    stored, scales = store(fp32_cache, name)
    attn = Attention("layer", num_heads, num_kv_heads, head_dim, scale=head_dim**-0.5)
    attn.kv_cache, attn.kv_format, attn.kv_scales = stored, kv_format(name), scales
    q = torch.randn(len(lens), num_heads * head_dim)
    new_k, new_v = torch.randn(2, len(lens), num_kv_heads * head_dim)
    meta = build_attention_metadata([1] * len(lens), lens, tables, block_size, torch.device("cpu"))
    with set_forward_context(ForwardContext(attn_metadata={"layer": meta})):
        out = attn(q, new_k, new_v)
    for i, (seq_len, table) in enumerate(zip(lens, tables, strict=True)):  # what fp32 KV would hold
        last = table[(seq_len - 1) // block_size], (seq_len - 1) % block_size
        fp32_cache[last[0], 0, :, last[1]] = new_k[i].view(num_kv_heads, head_dim)
        fp32_cache[last[0], 1, :, last[1]] = new_v[i].view(num_kv_heads, head_dim)
    references = []
    for cache in (widen(attn.kv_cache, scales), fp32_cache):
        expected = []
        for i, (seq_len, table) in enumerate(zip(lens, tables, strict=True)):
            blocks = cache[table]  # [nb, 2, Hkv, bs, D]
            k = blocks[:, 0].transpose(1, 2).reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [S, Hkv, D]
            v = blocks[:, 1].transpose(1, 2).reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [S, Hkv, D]
            expected.append(reference_attention(q[i].view(1, num_heads, head_dim), k, v, seq_len - 1))
        references.append(torch.cat(expected))
    return out, references[0], references[1]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("route", ["torch", *ARCHS])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 128), (8, 2, 24)])
def test_decode_reads_every_format_within_its_tolerance(name: str, route: str, num_heads: int,
                                                        num_kv_heads: int, head_dim: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """head_dim 24: the scalar loop on AVX-512 (not a multiple of 16 floats), vectors on AVX2."""
    monkeypatch.setenv("KVRELAY_NATIVE_KERNELS", "0" if route == "torch" else "1")
    if route != "torch":
        monkeypatch.setenv("KVRELAY_NATIVE_ARCH", route)
        require_kernel("paged_decode", route, native.paged_decode_kernel)
    out, exact, fp32 = decode_step(name, num_heads, num_kv_heads, head_dim, [1, 15, 17, 40, 130])
    torch.testing.assert_close(out, exact, atol=2e-5, rtol=2e-5)
    assert (out - fp32).abs().max().item() <= TOLERANCE_VS_FP32[name] * fp32.abs().max().item()


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_native_decode_any_group_and_head_dim_in_every_format(name: str, group: int, head_dim: int,
                                                              arch: str) -> None:
    """The kernel reads each KV row once for the query heads of its group, at most 4 heads a pass
    (groups 5 and 8: two passes). head_dim 40 is a multiple of no vector width (the route for any
    D). Lengths: one token, a partial last block, whole blocks."""
    kernel = require_kernel("paged_decode", arch, native.paged_decode_kernel)
    check_kernel_against_widened_values(kernel, name, group, head_dim, block_size=16)


@pytest.mark.parametrize("name", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("block_size", [8, 32])
def test_native_decode_blocks_smaller_or_larger_than_a_vector_of_rows(name: str, block_size: int,
                                                                      arch: str) -> None:
    """Scores are summed VLEN (16, 8 or 4) rows at a time: a block of 8 rows is less than one such
    group on AVX-512 (the rest repeat its last row, never read past it), 32 rows are several."""
    kernel = require_kernel("paged_decode", arch, native.paged_decode_kernel)
    check_kernel_against_widened_values(kernel, name, 3, 64, block_size)


def check_kernel_against_widened_values(kernel: native.PagedDecode, name: str, group: int, head_dim: int,
                                        block_size: int) -> None:
    """The kernel over a cache stored in format `name` against attention over the values it holds,
    with 1 thread (whole sequences per work item) and 2 (4 sequences: split by KV head)."""
    torch.manual_seed(5)
    num_kv_heads, lens = 2, [1, 7, 16, 45]
    counts = [cdiv(n, block_size) for n in lens]
    perm = torch.randperm(sum(counts) + 2)
    tables = torch.zeros(len(lens), max(counts), dtype=torch.int64)
    for i, table in enumerate(perm[:sum(counts)].split(counts)):
        tables[i, :len(table)] = table
    stored, scales = store(torch.randn(len(perm), 2, num_kv_heads, block_size, head_dim), name)
    exact = widen(stored, scales)  # [N, 2, Hkv, bs, D]
    num_heads = group * num_kv_heads
    q = torch.randn(len(lens), num_heads * head_dim)
    out = torch.empty_like(q)
    threads_before = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            kernel(q, stored, tables, torch.tensor(lens), out, head_dim**-0.5, scales)
        finally:
            torch.set_num_threads(threads_before)
        for i, seq_len in enumerate(lens):
            blocks = exact[tables[i, :counts[i]]]  # [nb, 2, Hkv, bs, D]
            k = blocks[:, 0].transpose(1, 2).reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [S, Hkv, D]
            v = blocks[:, 1].transpose(1, 2).reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [S, Hkv, D]
            expected = reference_attention(q[i].view(1, num_heads, head_dim), k, v, seq_len - 1)
            torch.testing.assert_close(out[i:i + 1], expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "float16"])
def test_out_of_range_values_saturate_instead_of_becoming_inf(name: str) -> None:
    fmt = kv_format(name)
    scale = torch.ones(2, 1) if fmt.is_fp8 else None
    x = torch.tensor([[[1e6, -1e6, 0.5]], [[2.0, -3.0, 1e-3]]])  # [T=2, Hkv=2... as [2, 1, 3]]
    stored = quantize_kv(x, fmt, scale)
    assert torch.isfinite(stored.float()).all()
    widened = stored.float()
    assert widened[0, 0, 0].item() == fmt.max_value and widened[0, 0, 1].item() == -fmt.max_value


def test_native_kernel_refuses_missing_or_unexpected_scales() -> None:
    kernel = require_kernel("paged_decode", "native", native.paged_decode_kernel)
    q, out = torch.randn(1, 64), torch.empty(1, 64)
    tables, lens = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    fp8 = torch.zeros(1, 2, 1, 16, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="needs kv_scales"):
        kernel(q, fp8, tables, lens, out, 1.0)
    with pytest.raises(ValueError, match=r"kv_scales must be a contiguous CPU float32 \[2, 1\]"):
        kernel(q, fp8, tables, lens, out, 1.0, torch.ones(2, 3))
    with pytest.raises(ValueError, match="fp8 KV caches only"):
        bf16 = torch.zeros(1, 2, 1, 16, 64, dtype=torch.bfloat16)
        kernel(q, bf16, tables, lens, out, 1.0, torch.ones(2, 1))
    with pytest.raises(ValueError, match="kv_cache must be a CPU tensor of"):
        kernel(q, torch.zeros(1, 2, 1, 16, 64, dtype=torch.float64), tables, lens, out, 1.0)


def test_kv_cache_dtype_spellings_and_auto() -> None:
    assert CacheConfig(cache_dtype="fp8").cache_dtype == "fp8_e4m3"
    assert CacheConfig(cache_dtype="bf16").cache_dtype == "bfloat16"
    assert CacheConfig().cache_dtype == "auto"
    assert resolve_kv_format("auto", "bfloat16").name == "bfloat16"
    assert resolve_kv_format("fp8_e5m2", "float32").element_size == 1
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, float16, "
                                         "fp8_e4m3, fp8_e5m2 .* got 'int8'"):
        CacheConfig(cache_dtype="int8")


def test_fp8_scales_are_powers_of_two_with_headroom() -> None:
    fmt = kv_format("fp8_e4m3")
    amax = torch.tensor([[1.0, 300.0], [1e-3, 448.0]])
    scales = scales_from_amax(amax, fmt)
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)
    assert (amax / scales <= fmt.max_value / 1.25).all() and (amax / scales > fmt.max_value / 2.5).all()

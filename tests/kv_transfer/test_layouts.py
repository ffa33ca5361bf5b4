"""Block layouts of two engines and the conversion between them (kvrelay/kv_transfer/layouts.py), and
the compatibility check a pull reader makes with it."""

from __future__ import annotations

import pytest
import torch

from kvrelay.kv_transfer.compat import compat_fingerprint, kv_incompatibility
from kvrelay.kv_transfer.layouts import (
    KVRELAY_LAYOUT,
    VLLM_CPU_LAYOUT,
    can_convert,
    convert_blocks,
    vllm_cpu_layout,
)

H, BS, D, NUM_BLOCKS = 3, 8, 4, 5


def _kv(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_BLOCKS, H, BS, D, generator=g), torch.randn(NUM_BLOCKS, H, BS, D, generator=g)


def _kvrelay_layer(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.stack((k, v), dim=1).contiguous()  # [num_blocks, 2, H, bs, D]


def _vllm_layer(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """vLLM CPU_ATTN ("vec"): per head K transposed [D, bs], then V [bs, D]; viewed in kvrelay's shape."""
    k_t = k.transpose(-1, -2).reshape(NUM_BLOCKS, H, -1)  # [blocks, H, D*bs]
    per_head = torch.cat((k_t, v.reshape(NUM_BLOCKS, H, -1)), dim=2)  # [blocks, H, 2*bs*D]
    return per_head.contiguous().view(NUM_BLOCKS, 2, H, BS, D)


def test_vllm_blocks_become_kvrelay_blocks_and_back() -> None:
    k, v = _kv(0)
    layers = [_vllm_layer(k, v), _vllm_layer(v, k)]
    convert_blocks(layers, [0, 2, 4], VLLM_CPU_LAYOUT, KVRELAY_LAYOUT)
    for layer, (kk, vv) in zip(layers, ((k, v), (v, k)), strict=True):
        assert torch.equal(layer[[0, 2, 4]], _kvrelay_layer(kk, vv)[[0, 2, 4]])
        assert torch.equal(layer[[1, 3]], _vllm_layer(kk, vv)[[1, 3]])  # blocks not named: untouched
    convert_blocks(layers, [0, 2, 4], KVRELAY_LAYOUT, VLLM_CPU_LAYOUT)
    assert torch.equal(layers[0], _vllm_layer(k, v)) and torch.equal(layers[1], _vllm_layer(v, k))


def test_only_known_layout_pairs_convert() -> None:
    assert can_convert(KVRELAY_LAYOUT, VLLM_CPU_LAYOUT) and can_convert(VLLM_CPU_LAYOUT, KVRELAY_LAYOUT)
    assert vllm_cpu_layout("vec16") == vllm_cpu_layout("vec") == VLLM_CPU_LAYOUT
    amx = vllm_cpu_layout("amx")
    assert amx != VLLM_CPU_LAYOUT and not can_convert(amx, KVRELAY_LAYOUT) and can_convert(amx, amx)
    with pytest.raises(ValueError, match="no conversion"):
        convert_blocks([_kvrelay_layer(*_kv(1))], [0], amx, KVRELAY_LAYOUT)


def _fingerprint(layout: str, dtype: str = "float32") -> dict[str, object]:
    return compat_fingerprint(model="llama/L2/w0", kv_cache_dtype=dtype, kv_scales="none", layout=layout,
                              block_size=128, head_size=64, num_kv_heads=3)


def test_a_reader_that_converts_accepts_a_convertible_layout_and_nothing_else_that_differs() -> None:
    ours, vllm = _fingerprint(KVRELAY_LAYOUT), _fingerprint(VLLM_CPU_LAYOUT)
    assert kv_incompatibility(ours, "a", 1, vllm, "b", 1, convert_layouts=True) is None
    assert "layout differs" in str(kv_incompatibility(ours, "a", 1, vllm, "b", 1))  # a reader that cannot
    fp8 = _fingerprint(VLLM_CPU_LAYOUT, "fp8_e4m3")
    refused = kv_incompatibility(ours, "a", 1, fp8, "b", 1, convert_layouts=True)
    assert refused == "kv_cache_dtype differs: ours 'float32', theirs 'fp8_e4m3'"
    amx = _fingerprint(vllm_cpu_layout("amx"))
    opaque = kv_incompatibility(ours, "a", 1, amx, "b", 1, convert_layouts=True)
    assert "no conversion between them" in str(opaque)
    other_tp = kv_incompatibility(ours, "a", 1, vllm, "b", 2, convert_layouts=True)
    assert "tensor_parallel_size (ours 1, theirs 2)" in str(other_tp)

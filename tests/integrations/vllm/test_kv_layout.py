"""vLLM's KV cache as the adapter describes it, and what it refuses, with stand-ins of vLLM's config
objects (the ISA lookup, the one call into vLLM, is replaced)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvrelay.integrations.vllm import kv_layout
from kvrelay.integrations.vllm.kv_layout import (
    UnsupportedVllmCache,
    VllmCacheShape,
    describe_cache,
    kv_cache_spec,
    kvrelay_views,
)
from kvrelay.kv_transfer.layouts import VLLM_CPU_LAYOUT


class FullAttentionSpec(SimpleNamespace):
    pass


class MLAAttentionSpec(SimpleNamespace):
    pass


def _config(spec: Any = None, groups: int = 1) -> SimpleNamespace:
    spec = spec or FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64, head_size_v=64,
                                     dtype=torch.float32)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=names, kv_cache_spec=spec)] * groups)


@pytest.fixture(autouse=True)
def vec_isa(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_layout, "cpu_attn_isa", lambda dtype, block_size, head_size: "vec")


def test_a_cpu_attn_cache_is_described_and_fingerprinted_with_its_layout() -> None:
    shape = describe_cache(_config(), "auto", "cpu")
    names = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
    assert shape == VllmCacheShape(names, 128, 3, 64, "float32", VLLM_CPU_LAYOUT)
    spec = kv_cache_spec(shape, "llama/L2/w0", tp_rank=0, tp_size=1)
    assert spec.fingerprint["layout"] == VLLM_CPU_LAYOUT and spec.fingerprint["num_kv_heads"] == 3
    assert spec.block_bytes == 3 * 128 * 2 * 64 * 4


@pytest.mark.parametrize(("config", "cache_dtype", "platform", "reason"), [
    (_config(), "auto", "cuda", "support vLLM's CPU platform"),
    (_config(groups=2), "auto", "cpu", "one KV cache group"),
    (_config(MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)),
     "auto", "cpu", "MLA"),
    (_config(FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64, head_size_v=64,
                               dtype=torch.uint8)), "fp8", "cpu", "it refuses fp8"),
    (_config(FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64, head_size_v=32,
                               dtype=torch.float32)), "auto", "cpu", "V head size 32"),
])
def test_caches_kvrelay_cannot_describe_are_refused_naming_why(config: Any, cache_dtype: str, platform: str,
                                                               reason: str) -> None:
    with pytest.raises(UnsupportedVllmCache, match=reason):
        describe_cache(config, cache_dtype, platform)


def test_registered_tensors_are_viewed_in_kvrelays_block_shape_as_the_same_bytes() -> None:
    shape = describe_cache(_config(), "auto", "cpu")
    buffer = torch.arange(2 * 5 * 3 * 128 * 128, dtype=torch.float32)  # one buffer, like vLLM's
    caches = {name: buffer[i * 5 * 3 * 128 * 128:(i + 1) * 5 * 3 * 128 * 128].view(5, 3, 128, 128)
              for i, name in enumerate(shape.layer_names)}
    views = kvrelay_views(caches, shape)
    for name, view in views.items():
        assert view.shape == (5, 2, 3, 128, 64) and view.data_ptr() == caches[name].data_ptr()
    with pytest.raises(UnsupportedVllmCache, match="expects"):
        kvrelay_views({name: t.view(5, 3, 64, 256) for name, t in caches.items()}, shape)
    with pytest.raises(UnsupportedVllmCache, match="not contiguous"):
        strided = {name: t.transpose(1, 2).contiguous().transpose(1, 2) for name, t in caches.items()}
        kvrelay_views(strided, shape)

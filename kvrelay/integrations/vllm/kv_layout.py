"""vLLM's KV cache, described from what vLLM hands over: its KV cache config and the tensors it
registers, never assumed.

On vLLM's CPU platform (CPU_ATTN, the backend of every non-MLA model there) each layer is a view
`[num_blocks, num_kv_heads, block_size, 2 * head_size]` of one shared int8 buffer, one block a
dense page; the kernels of ISA "vec"/"vec16" store per head K transposed, then V (the layout
kvrelay/kv_transfer/layouts.py names VLLM_CPU_LAYOUT, and the compatibility digest carries). The
adapter hands kvrelay's connectors a byte-identical view of each layer in kvrelay's block shape
`[num_blocks, 2, H_kv, block_size, D]`: they move, checksum and store whole blocks, so the labels
do not matter, and the digest's `layout` field says what the bytes are.

Refused at start, with the reason: another platform (its layouts differ), more than one KV cache
group (hybrid models), MLA, an fp8 KV cache (vLLM CPU cannot transfer it), K and V of different
head sizes, layers that are not dense block pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvrelay.kv_transfer.base import KVCacheSpec
from kvrelay.kv_transfer.compat import compat_fingerprint
from kvrelay.kv_transfer.layouts import vllm_cpu_layout

if TYPE_CHECKING:
    import torch

_DTYPE_NAMES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


class UnsupportedVllmCache(ValueError):
    """vLLM's KV cache is one kvrelay's connectors cannot describe."""


@dataclass(frozen=True)
class VllmCacheShape:
    """The one KV cache group of a vLLM instance, as this rank holds it."""

    layer_names: tuple[str, ...]
    block_size: int
    num_kv_heads: int  # this rank's
    head_size: int
    dtype: str  # a kvrelay KV format name: float32, bfloat16, float16
    layout: str  # layouts.py

    @property
    def layer_shape_tail(self) -> tuple[int, int, int]:
        """A layer's shape after num_blocks, as vLLM's CPU backend registers it."""
        return self.num_kv_heads, self.block_size, 2 * self.head_size


def describe_cache(kv_cache_config: Any, cache_dtype: str, platform: str) -> VllmCacheShape:
    """The cache vLLM allocates from `kv_cache_config` (both roles have it); UnsupportedVllmCache
    for one kvrelay cannot describe."""
    if platform != "cpu":
        raise UnsupportedVllmCache(
            f"kvrelay's vLLM connectors support vLLM's CPU platform (CPU_ATTN) in this version; this "
            f"vLLM runs on {platform!r}, whose KV layout they do not describe")
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise UnsupportedVllmCache(
            f"kvrelay's vLLM connectors support one KV cache group (full attention); this model has "
            f"{len(groups)} (a hybrid or sliding-window model)")
    spec = groups[0].kv_cache_spec
    head_size, head_size_v = int(getattr(spec, "head_size", 0)), getattr(spec, "head_size_v", None)
    if type(spec).__name__.startswith("MLA") or not head_size:
        raise UnsupportedVllmCache(
            f"kvrelay's vLLM connectors do not support {type(spec).__name__} (MLA) caches")
    if head_size_v not in (None, head_size):
        raise UnsupportedVllmCache(f"K head size {head_size} and V head size {head_size_v} differ")
    if cache_dtype != "auto" or str(spec.dtype) not in _DTYPE_NAMES:
        raise UnsupportedVllmCache(
            f"kv_cache_dtype {cache_dtype!r} ({spec.dtype}): vLLM's CPU platform transfers only caches "
            "in the model's dtype (float32, bfloat16, float16; it refuses fp8); use --kv-cache-dtype auto")
    dtype = _DTYPE_NAMES[str(spec.dtype)]
    return VllmCacheShape(layer_names=tuple(groups[0].layer_names), block_size=int(spec.block_size),
                          num_kv_heads=int(spec.num_kv_heads), head_size=head_size, dtype=dtype,
                          layout=vllm_cpu_layout(cpu_attn_isa(spec.dtype, int(spec.block_size), head_size)))


def cpu_attn_isa(dtype: Any, block_size: int, head_size: int) -> str:
    """The ISA vLLM's CPU attention picks for this cache (it decides how a block is packed)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(dtype, block_size, head_size, "auto"))


def kv_cache_spec(shape: VllmCacheShape, model: str, tp_rank: int, tp_size: int) -> KVCacheSpec:
    """kvrelay's KVCacheSpec of this rank's cache, with the compatibility fingerprint."""
    fingerprint = compat_fingerprint(model=model, kv_cache_dtype=shape.dtype, kv_scales="none",
                                     layout=shape.layout, block_size=shape.block_size,
                                     head_size=shape.head_size, num_kv_heads=shape.num_kv_heads * tp_size)
    return KVCacheSpec(block_size=shape.block_size, num_layers=len(shape.layer_names),
                       num_kv_heads=shape.num_kv_heads, head_dim=shape.head_size, dtype=shape.dtype,
                       layer_names=shape.layer_names, fingerprint=fingerprint, tp_rank=tp_rank,
                       tp_size=tp_size)


def kvrelay_views(kv_caches: dict[str, torch.Tensor], shape: VllmCacheShape) -> dict[str, torch.Tensor]:
    """Each layer vLLM registered, viewed in kvrelay's block shape (the same bytes)."""
    missing = [name for name in shape.layer_names if name not in kv_caches]
    if missing:
        raise UnsupportedVllmCache(f"vLLM registered no KV cache for layers {missing[:4]}")
    views = {}
    for name in shape.layer_names:
        kv = kv_caches[name]
        if kv.dim() != 4 or tuple(kv.shape[1:]) != shape.layer_shape_tail:
            raise UnsupportedVllmCache(
                f"layer {name}'s KV cache is {tuple(kv.shape)}; kvrelay expects [num_blocks, "
                f"{', '.join(map(str, shape.layer_shape_tail))}] (vLLM's CPU_ATTN layout)")
        if not kv.is_contiguous():
            raise UnsupportedVllmCache(
                f"layer {name}'s KV cache is not contiguous (strides {kv.stride()}): kvrelay moves a block "
                "as one dense page")
        num_blocks = kv.shape[0]
        # the same bytes as [num_blocks, 2, H_kv, block_size, D]
        views[name] = kv.view(num_blocks, 2, shape.num_kv_heads, shape.block_size, shape.head_size)
    return views

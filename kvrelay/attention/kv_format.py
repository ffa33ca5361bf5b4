"""KV cache formats: the element type the paged KV cache stores, independent of the weights' dtype.

`kv_cache_dtype` (vLLM's name and values, plus float32):
  auto       the model's dtype (the default)
  float32    4 bytes per element
  bfloat16   2 bytes; 8 exponent bits, so any value the model computes fits (7 mantissa bits)
  float16    2 bytes; 10 mantissa bits, but values above 65504 become inf
  fp8_e4m3   1 byte (`fp8` is an alias); 3 mantissa bits, range +-448 after scaling
  fp8_e5m2   1 byte; 2 mantissa bits, range +-57344 after scaling

fp8 stores `value / scale`, saturated to the format's range, with one scale per layer, per KV
head, for K and for V. The scales are calibrated once when the engine starts (see
`kvrelay/worker/kv_calibration.py`), not computed at write time: a scale must stay fixed for as
long as any block written with it lives (prefix caching keeps blocks for the whole run, and P/D
and offload ship them to other instances), so a write-time scale would need a scale per block
stored and moved beside the block. The calibrated scales are a deterministic function of the
weights, rounded to powers of two (so quantizing is exact apart from fp8's own rounding); both
sides of a transfer derive the same ones, and they are part of the compatibility digest anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.config import KV_CACHE_DTYPES, normalize_kv_cache_dtype

__all__ = ["KV_CACHE_DTYPES", "KVFormat", "dequantize_kv", "kv_dtype_names", "kv_format",
           "normalize_kv_cache_dtype", "quantize_kv", "resolve_kv_format"]


@dataclass(frozen=True)
class KVFormat:
    """One resolved KV cache format (never "auto")."""

    name: str  # "float32" | "bfloat16" | "float16" | "fp8_e4m3" | "fp8_e5m2"
    torch_dtype: torch.dtype  # what the cache tensors hold
    element_size: int  # bytes per stored element
    kernel_code: int  # the element kind paged_decode.c reads (its KV_* constants)

    @property
    def is_fp8(self) -> bool:
        return self.element_size == 1

    @property
    def max_value(self) -> float:
        """The largest finite stored magnitude (fp8 saturates to it on write)."""
        return float(torch.finfo(self.torch_dtype).max)

    @property
    def scales_policy(self) -> str:
        """How this format's values relate to the true K/V (part of the compatibility digest)."""
        return "calibrated-pow2-per-layer-head-kv-v1" if self.is_fp8 else "none"


_FORMATS = {
    "float32": KVFormat("float32", torch.float32, 4, 0),
    "bfloat16": KVFormat("bfloat16", torch.bfloat16, 2, 1),
    "float16": KVFormat("float16", torch.float16, 2, 2),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 1, 3),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 1, 4),
}


def resolve_kv_format(kv_cache_dtype: str, model_dtype: str) -> KVFormat:
    """The format a cache of `kv_cache_dtype` stores for a model computing in `model_dtype`."""
    name = normalize_kv_cache_dtype(kv_cache_dtype)
    return _FORMATS[model_dtype if name == "auto" else name]


def kv_format(name: str) -> KVFormat:
    """A resolved format by its name (as KVCacheSpec.dtype carries it)."""
    if name not in _FORMATS:
        raise ValueError(f"unknown KV cache format {name!r}; formats are {', '.join(_FORMATS)}")
    return _FORMATS[name]


def kv_dtype_names() -> tuple[str, ...]:
    """Every resolved format name."""
    return tuple(_FORMATS)


def quantize_kv(x: torch.Tensor, fmt: KVFormat, scale: torch.Tensor | None) -> torch.Tensor:
    """x [..., Hkv, D] in the model's dtype -> the stored values. fp8: x / scale (scale [Hkv, 1],
    one per head), saturated to the format's range (an out-of-range value becomes the largest
    one, not inf or NaN); the other formats round to nearest."""
    if fmt.name == "float16":  # beyond 65504 float16 has only inf
        return x.clamp(-fmt.max_value, fmt.max_value).to(fmt.torch_dtype)
    if not fmt.is_fp8:
        return x.to(fmt.torch_dtype)
    assert scale is not None, "fp8 KV needs scales"
    limit = fmt.max_value
    return (x.float() / scale).clamp_(-limit, limit).to(fmt.torch_dtype)


def dequantize_kv(stored: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """The inverse of quantize_kv, in `dtype`: stored [..., Hkv, L, D] with scale [Hkv, 1, 1]."""
    if scale is None:
        return stored.to(dtype)
    return (stored.float() * scale).to(dtype)

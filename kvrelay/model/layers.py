"""Building blocks of the llama family: RMSNorm, rotary position embedding, gated SiLU MLP."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.kernels.native import elementwise_kernels, linear_kernel

Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (x, weight, eps) -> normed x
MatMul = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]  # (x, weight, bias)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)  # one fused kernel


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps) over the last dimension.

    `norm` is the route of `forward` (torch's fused kernel; the batch-invariant mode sets
    `invariant_rms_norm`); `add_and_norm` is the native kernel on the CPU in float32 either way."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.norm: Norm = torch_rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight, self.eps)

    def add_and_norm(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += h, in place (the residual stream moves on), and return the norm of the sum.
        One pass of native code on the CPU in float32; torch's add_ and rms_norm elsewhere."""
        kernels = elementwise_kernels() if _native_f32(residual, h) and residual.dim() == 2 else None
        if kernels is None:
            return self(residual.add_(h))
        return kernels.add_rms_norm(h, residual, self.weight, self.eps)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ weight[out, in]^T (+ bias) -> [T, out]; the same result as `F.linear`.

    On the CPU in float32 it picks, by the number of rows T:
    - 1..128 rows (1..512 where torch has no oneDNN): the native kernel (`linear.c`). Measured
      on an AMD EPYC (2 threads, MKL; all 121 weights of SmolLM2 in turn, so each is read from
      memory as in a decode step): at 16-64 rows 1.2-1.9x faster than MKL through `F.linear`
      (MKL runs at 50-100 GFLOP/s there, the kernel at 100-170), from 64 to 512 rows about even
      with MKL or a little ahead. At 1-2 rows (single-stream decode, where reading the weight is
      the whole cost) it streams the weights at 13 GB/s against 5.5 for the row-split `bmm`
      below: on an Intel Xeon (AVX-512, 2026-12-02) one pass over SmolLM2's weights took 41 ms
      against 97 at one thread and 38 against 70 at two, and a decode step of one or two
      sequences ran 2.2-2.3x faster at one thread, with the AVX-512 and the AVX2 (`haswell`) build.
      On an AMD EPYC the row-split `bmm` was the faster until the kernel read 1-2 rows' weights
      one row after another (2026-12-03): now both stream at 29-31 GB/s there, and single-stream
      decode runs at the same speed on either route (medians of 10 alternating runs, 39.6 and
      39.9 tok/s).
    - when the kernel is unavailable or the shapes don't fit it, up to `_ROW_SPLIT_MAX_TOKENS`
      rows: the weight's rows cut in `_ROW_PARTS` equal parts multiplied as one `bmm`, so each
      thread streams its own part (2.6x faster than `F.linear` at one row on the EPYC, where
      MKL's one-row product at two threads is pathological).
    - past 128 rows (prefill chunks), oneDNN through torch (`mkldnn._linear_pointwise`) on the
      weight as it is stored (no packed copy): on an AMD EPYC (2 threads, 2026-12-03) it ran
      SmolLM2's weights at 173-190 GFLOP/s at 600-2048 rows against 131-142 for `F.linear`
      (MKL, whose AMD code path is slower) and 151-156 for the native kernel; on an Intel Xeon
      the two libraries measured within a few percent of each other (oneDNN with a packed
      weight -2% to +4% at 512-2048 rows, 2026-12-02). Between 160 and 512 rows oneDNN was
      4-14% ahead of the native kernel on the EPYC (all 120 layer weights in turn, best of 5),
      7-30% with both held to AVX2; at 64 rows and below the kernel leads (136 against 128
      GFLOP/s at 64 rows, 107 against 87 with AVX2), at 128 they are even. `F.linear` past 512
      rows where oneDNN is not built in.
    - anything else: `F.linear`.
    """
    out_features, in_features = weight.shape
    if x.device.type != "cpu" or weight.dtype != torch.float32 or x.dim() != 2:
        return F.linear(x, weight, bias)
    num_tokens = x.shape[0]
    if num_tokens > _NATIVE_MAX_TOKENS and _ONEDNN and weight.is_contiguous():
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if _NATIVE_MIN_TOKENS <= num_tokens <= _NATIVE_MAX_TOKENS_WITHOUT_ONEDNN:
        kernel = linear_kernel()
        if kernel is not None and kernel.fits(x, weight, bias):
            return kernel(x, weight, bias)
    if out_features % _ROW_PARTS or num_tokens > _ROW_SPLIT_MAX_TOKENS:
        return F.linear(x, weight, bias)
    parts = weight.view(_ROW_PARTS, out_features // _ROW_PARTS, in_features)  # [P, out/P, in]
    out = torch.bmm(parts, x.t().expand(_ROW_PARTS, in_features, num_tokens))  # [P, out/P, T]
    # NOTE: contiguous(): a reshape alone would be a column-major view, which every later op (and
    # scaled_dot_product_attention's fast path) pays for. Free when T == 1.
    out = out.permute(2, 0, 1).contiguous().view(num_tokens, out_features)  # [T, out]
    return out if bias is None else out.add_(bias)


def _native_f32(*tensors: torch.Tensor) -> bool:
    """Whether native CPU float32 code may take these (they may still need a layout check)."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


_NATIVE_MIN_TOKENS = 1
_NATIVE_MAX_TOKENS = 128  # past it oneDNN, where torch has it
_NATIVE_MAX_TOKENS_WITHOUT_ONEDNN = 512  # the kernel still beats F.linear (MKL) up to here
_ROW_PARTS = 2
_ROW_SPLIT_MAX_TOKENS = 64
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear_route_starts() -> tuple[int, ...]:
    """The row counts at which `linear` takes another route on this build (the planner samples
    decode steps on both sides of each: the step's cost jumps there)."""
    native_max = _NATIVE_MAX_TOKENS if _ONEDNN else _NATIVE_MAX_TOKENS_WITHOUT_ONEDNN
    return _NATIVE_MIN_TOKENS, native_max + 1


class Linear(nn.Linear):
    """nn.Linear whose forward is `matmul`: `linear` above (the batch-invariant mode sets
    `invariant_linear`, kvrelay/model/invariant.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.matmul: MatMul = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * I]
        kernels = elementwise_kernels() if _native_f32(gate_up) and gate_up.dim() == 2 else None
        if kernels is not None:
            return self.down_proj(kernels.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # 2 x [T, I]
        return self.down_proj(F.silu(gate).mul_(up))


def rope_inverse_frequencies(
    head_dim: int, theta: float, rope_scaling: dict[str, Any] | None
) -> torch.Tensor:
    """Per-pair rotation speeds, [head_dim // 2] float32 (on the CPU, whatever the default device)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    scaling = rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}; kvrelay supports 'default' and 'llama3'")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 long-context rope: slow down low frequencies by `factor`, keep high ones,
    interpolate smoothly in between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half (GPT-NeoX style) rope. `cos_sin` runs once per step; `apply_rotary` once per layer.
    `table`, when set (the batch-invariant mode: kvrelay/model/invariant.py's RotaryTable), serves
    `cos_sin` from values computed once per position."""

    def __init__(self, head_dim: int, theta: float, rope_scaling: dict[str, Any] | None) -> None:
        super().__init__()
        # A plain attribute, not a buffer: `module.to(dtype)` must not round it to low precision.
        self.inv_freq = rope_inverse_frequencies(head_dim, theta, rope_scaling)  # [D/2] float32
        self.table: Any = None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos [T, 1, D] and a signed sin [T, 1, D] (-sin on the first half),
        broadcastable over heads, so that rotating is x * cos + swap_halves(x) * sin."""
        if self.table is not None:
            return self.table.cos_sin(positions, dtype)  # type: ignore[no-any-return]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        cos = torch.cat((cos, cos), dim=-1).to(dtype)  # [T, D]
        sin = torch.cat((-sin, sin), dim=-1).to(dtype)  # [T, D]
        return cos[:, None, :], sin[:, None, :]


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """`apply_rotary` in place: one native call on the CPU in float32 (heads and D contiguous
    within a token's row, any row stride), else torch, through a temporary."""
    kernels = elementwise_kernels() if _native_f32(x, cos, sin) and x.stride(-1) == 1 \
        and x.stride(-2) == x.shape[-1] else None
    if kernels is None:
        x.copy_(apply_rotary(x, cos, sin))
    else:
        kernels.rotary_(x, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, n_heads, D] (any row stride), cos/sin [T, 1, D] from `cos_sin` -> new [T, n_heads, D]."""
    x1, x2 = x.chunk(2, dim=-1)  # 2 x [T, n_heads, D/2]
    swapped = torch.cat((x2, x1), dim=-1)  # [T, n_heads, D]
    return torch.addcmul(x * cos, swapped, sin)

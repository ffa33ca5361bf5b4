"""The model's routes in the batch-invariant mode: each row's result depends on that row alone.

Outside the mode `linear` picks its route by the step's row count (the native kernel up to 128
rows, oneDNN above: kvrelay/model/layers.py), and the row count depends on what else the step
holds; torch's vectorised operators hand the tail of an array (whose length follows the step)
to a scalar routine whose last bit can differ. In the mode:
- every matrix product goes through `invariant_linear`: on the CPU the native kernel for every
  row count (`linear.c` splits the work over the weight's rows, never over K, and sums each dot
  product in the same order whatever rows share the call); a shape the kernel does not take
  runs one row at a time, so every row is the same call. On CUDA `F.linear`, with cuBLAS held
  to one algorithm per shape without split-K (kvrelay/worker/batch_invariance.py).
- every RMSNorm reduces its row in the native kernel's fixed order (`invariant_rms_norm`);
- rotary cos/sin come from `RotaryTable`, computed once per position at start.
Attention is the backend's (kvrelay/attention/backends/cpu_rows.py on the CPU).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.kernels.native import elementwise_kernels, linear_kernel
from kvrelay.model.layers import Linear, RMSNorm, RotaryEmbedding, torch_rms_norm


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ weight[out, in]^T (+ bias) -> [T, out], each row the same bits whatever T is."""
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    kernel = linear_kernel()
    if kernel is not None and kernel.fits(x, weight, bias):
        return kernel(x, weight, bias)
    # A shape the kernel does not take (K % 16, N % 4, a strided weight): one row at a time, so
    # each row is the same matrix-vector product whatever the batch. Slow, and rare in practice.
    out = x.new_empty(x.shape[0], weight.shape[0])  # [T, out]
    for i in range(x.shape[0]):
        torch.mv(weight, x[i], out=out[i])
    return out if bias is None else out.add_(bias)


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [..., D] in the native kernel's order (CPU, float32)."""
    kernels = elementwise_kernels() if x.device.type == "cpu" and x.dtype == torch.float32 else None
    if kernels is None:
        # NOTE: on CUDA torch's fused kernel, assumed to reduce a row in one thread block shaped by
        # the row's length alone; tests/gpu/test_batch_invariance_gpu.py is what proves it.
        return torch_rms_norm(x, weight, eps)
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # [N, D]
    return kernels.add_rms_norm(None, rows, weight, eps).view(x.shape)


class RotaryTable:
    """cos and sign-folded sin ([L, D] each, as `RotaryEmbedding.cos_sin` makes them) of every
    position below L, computed once at start; a step only gathers its positions' rows (no host
    sync, so a CUDA graph can capture it).

    Each value comes from Python's `math` (glibc's scalar double routines, rounded to float32),
    from the same float32 angle `cos_sin` uses. torch's vectorised cos gives an array's tail,
    whose place follows the step's length and thread count, to a scalar routine that may differ
    in the last bit; here a position's values never depend on the step that asks for them."""

    def __init__(self, inv_freq: torch.Tensor, length: int) -> None:
        positions = torch.arange(length, dtype=torch.int64).float()  # [L]
        angles = positions[:, None] * inv_freq.float().cpu()[None, :]  # [L, D/2] float32, as cos_sin
        flat = angles.double().reshape(-1).tolist()
        cos = torch.tensor(list(map(math.cos, flat)), dtype=torch.float64).float().view(angles.shape)
        sin = torch.tensor(list(map(math.sin, flat)), dtype=torch.float64).float().view(angles.shape)
        self.cos = torch.cat((cos, cos), dim=-1).to(inv_freq.device)  # [L, D]
        self.sin = torch.cat((-sin, sin), dim=-1).to(inv_freq.device)  # [L, D]

    def __len__(self) -> int:
        return int(self.cos.shape[0])

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T], each below len(self) -> cos [T, 1, D], sin [T, 1, D]."""
        cos = self.cos.index_select(0, positions).to(dtype)  # [T, D]
        sin = self.sin.index_select(0, positions).to(dtype)  # [T, D]
        return cos[:, None, :], sin[:, None, :]


def make_batch_invariant(model: nn.Module, max_model_len: int) -> None:
    """Set every layer of `model` on its batch-invariant route (see the module docstring), for
    positions below `max_model_len`."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.matmul = invariant_linear
        elif isinstance(module, RMSNorm):
            module.norm = invariant_rms_norm
        elif isinstance(module, RotaryEmbedding):
            module.table = RotaryTable(module.inv_freq, max_model_len)

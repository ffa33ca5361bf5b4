"""Attention backends, one chosen per engine at start: `cpu` (the native kernels), `torch` (any
device; the reference the others are tested against) and `triton` (CUDA)."""

from __future__ import annotations

import logging

import torch

from kvrelay.attention.backends.base import AttentionBackend, GraphInputs, PagedLayer
from kvrelay.attention.backends.cpu import CpuBackend
from kvrelay.attention.backends.reference import TorchBackend

logger = logging.getLogger(__name__)


def select_backend(requested: str, device: torch.device, num_kv_heads: int, head_dim: int, max_model_len: int,
                   latent: bool = False, batch_invariant: bool = False) -> AttentionBackend:
    """The backend `requested` names ("auto": cpu on the CPU, triton on CUDA), for a model
    whose cache has `num_kv_heads` heads (this rank's) of `head_dim`. MLA's latent cache and a
    head_dim the Triton kernels do not take (a power of two >= 16) run the torch route.
    `batch_invariant`: the route's variant that computes every query row alike, prefill or
    decode (docs/batch_invariance.md); the torch route has none."""
    if batch_invariant:
        return _invariant_backend(requested, device, num_kv_heads, head_dim, max_model_len, latent)
    if requested == "auto":
        requested = "cpu" if device.type == "cpu" else "triton"
        why_not_triton = _triton_unfit(head_dim, latent) if requested == "triton" else None
        if why_not_triton is not None:
            logger.info("attention: the torch route serves this model on %s (%s)", device, why_not_triton)
            requested = "torch"
    if requested == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' runs the native CPU kernels; the model is on {device}")
        return CpuBackend()
    if requested == "torch":
        return TorchBackend()
    if requested == "triton":
        problem = _triton_unfit(head_dim, latent)
        if problem is not None:
            raise ValueError(f"attention backend 'triton' cannot serve this model: {problem}; use 'torch'")
        from kvrelay.attention.backends.gpu import TritonBackend

        return TritonBackend(num_kv_heads, max_model_len)
    raise ValueError(f"unknown attention backend {requested!r}; choose auto, cpu, torch or triton")


def _invariant_backend(requested: str, device: torch.device, num_kv_heads: int, head_dim: int,
                       max_model_len: int, latent: bool) -> AttentionBackend:
    if requested == "auto":
        requested = "cpu" if device.type == "cpu" else "triton"
    problem = _triton_unfit(head_dim, latent) if requested == "triton" else None
    if latent or requested == "torch" or problem is not None:
        why = problem or ("MLA's latent cache runs the torch route" if latent
                          else "the torch route was asked for")
        raise ValueError(f"batch_invariant needs the cpu or triton attention route, and {why}: the torch "
                         "route prefills and decodes through different reductions")
    if requested == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' runs the native CPU kernels; the model is on {device}")
        from kvrelay.attention.backends.cpu_rows import RowsCpuBackend

        return RowsCpuBackend()
    if requested != "triton":
        raise ValueError(f"unknown attention backend {requested!r}; choose auto, cpu, torch or triton")
    from kvrelay.attention.backends.gpu import TritonBackend

    return TritonBackend(num_kv_heads, max_model_len, batch_invariant=True)


def _triton_unfit(head_dim: int, latent: bool) -> str | None:
    if latent:
        return "MLA's latent cache has no Triton kernels yet"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= 16"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


__all__ = ["AttentionBackend", "CpuBackend", "GraphInputs", "PagedLayer", "TorchBackend", "select_backend"]

"""The batch-invariant mode at start: what it supports, what it sets, and its numerics identity.

With `--batch-invariant` (`LLM(batch_invariant=True)`, `KVRELAY_BATCH_INVARIANT=1`) a request's
per-step logprobs are bitwise the same whatever it is batched with, however its prompt is
chunked, whether its context was computed, found in the prefix cache, loaded from an offload
tier or computed by a prefill instance. The parts (docs/batch_invariance.md):
- the model's routes (kvrelay/model/invariant.py): one matmul route for every row count, norms
  in a fixed order per row, rotary values computed once per position;
- the attention route's invariant variant (kvrelay/attention/backends/cpu_rows.py on the CPU,
  the Triton backend's prefill kernel for every row on CUDA);
- on CUDA, cuBLAS without split-K or reduced-precision reductions (`configure_cuda`);
- a `numerics` field in the KV compatibility fingerprint (kvrelay/kv_transfer/compat.py), so
  that a P and a D that would compute different bits refuse each other at the handshake and D
  recomputes: "default" outside the mode (any two hosts interoperate, as before), and with it
  everything the bits depend on (`numerics`).
"""

from __future__ import annotations

import functools
import os

import torch

from kvrelay.config import EngineConfig
from kvrelay.kernels.native import KernelUnavailable, numerics_target
from kvrelay.kv_transfer.compat import DEFAULT_NUMERICS
from kvrelay.model.spec import ModelSpec

_VERSION = "batch-invariant-v1"
_MAX_TP = 2  # a sum of two partial products is the same in either order; of three, not
_MIN_CUDA_CAPABILITY = (9, 0)  # Hopper: cuBLAS can be held off split-K; older GPUs pick it by M


def prepare(config: EngineConfig, spec: ModelSpec) -> None:
    """At an engine's start, in the mode: refuse what it cannot do (`check_supported`) and, on
    CUDA, set cuBLAS up (`configure_cuda`). Nothing outside the mode."""
    check_supported(config, spec)
    if config.model.batch_invariant and torch.device(config.model.device).type == "cuda":
        configure_cuda()


def check_supported(config: EngineConfig, spec: ModelSpec) -> None:
    """Raise ValueError naming what the mode cannot do with this model and configuration."""
    if not config.model.batch_invariant:
        return
    if spec.is_mla:
        raise ValueError(f"batch_invariant does not cover {spec.architecture}'s latent attention (MLA): its "
                         "cache runs the torch route, whose prefill and decode reduce differently")
    tp = config.parallel.tensor_parallel_size
    if tp > _MAX_TP:
        raise ValueError(f"batch_invariant supports tensor_parallel_size up to {_MAX_TP}, got {tp}: the "
                         "all-reduce of three or more ranks sums in an order that follows the message size")
    device = torch.device(config.model.device)
    if device.type == "cpu":
        try:
            numerics_target()
        except KernelUnavailable as e:
            raise ValueError(f"batch_invariant on the CPU needs the native kernels, unavailable here: {e}") \
                from None
    elif device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < _MIN_CUDA_CAPABILITY:
            raise ValueError(f"batch_invariant on CUDA needs compute capability {_MIN_CUDA_CAPABILITY} or "
                             f"newer (cuBLAS there can run without split-K); {device} has {capability}")


def numerics(config: EngineConfig) -> str:
    """The fingerprint's `numerics` field: DEFAULT_NUMERICS outside the mode; with it, what the
    bits depend on, which P and D must share, e.g. "batch-invariant-v1; cpu rows; tp1; float32;
    kernels 16-lane fma; cc ... ; src 3f2a9c1b; torch 2.13.0+cpu AVX512"."""
    if not config.model.batch_invariant:
        return DEFAULT_NUMERICS
    device = torch.device(config.model.device)
    parts = [_VERSION, f"tp{config.parallel.tensor_parallel_size}", config.model.dtype]
    if device.type == "cpu":
        parts += ["attention cpu rows", f"kernels {numerics_target()}",
                  f"torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()}"]
    else:
        parts += ["attention triton prefill", _cuda_identity(device)]
    return "; ".join(parts)


def _cuda_identity(device: torch.device) -> str:
    import triton

    major, minor = torch.cuda.get_device_capability(device)
    return (f"{torch.cuda.get_device_name(device)} sm{major}{minor}; torch {torch.__version__} cuda "
            f"{torch.version.cuda}; triton {triton.__version__}")


@functools.cache
def configure_cuda() -> None:
    """cuBLAS on one algorithm per shape without split-K, no TF32 and no reduced-precision
    reductions (what vLLM's batch-invariant mode sets on Hopper and newer). The workspace
    variables are read when cuBLAS makes its first handle: call this before any CUDA matmul."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
    os.environ["CUBLASLT_WORKSPACE_SIZE"] = "1"
    matmul = torch.backends.cuda.matmul
    matmul.allow_fp16_reduced_precision_reduction = (False, False)
    matmul.allow_bf16_reduced_precision_reduction = (False, False)
    matmul.fp32_precision = "ieee"
    torch.backends.cuda.preferred_blas_library("cublaslt")

"""How many KV blocks a worker can hold: a byte budget on the CPU, a measurement on a GPU.

On the CPU the budget is `kv_cache_memory` (512MiB when not set). On a GPU it is what vLLM's
`--gpu-memory-utilization` leaves: this instance may use that share of the GPU's total memory,
and the KV cache gets what remains of it after the weights, the peak activations of a profiling
forward as large as the largest step, and the memory CUDA itself took meanwhile (cuBLAS
workspaces, the allocator's overhead). The CUDA context, created before the first measurement,
is not counted: the share left over (10% at the default 0.9) covers it. Two instances on one GPU
each take their own share (`kvrelay up` splits the requested one between them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvrelay.config import DEFAULT_CPU_KV_CACHE_MEMORY, CacheConfig

_MIB = 1024**2


@dataclass(frozen=True)
class GpuMemory:
    """One reading of a GPU's memory from this process."""

    total: int
    free: int
    torch_reserved: int  # what this process's torch allocator holds

    @property
    def non_torch(self) -> int:
        """Memory in use on the device that this process's torch allocator does not hold (other
        processes, CUDA libraries' workspaces)."""
        return self.total - self.free - self.torch_reserved

    @classmethod
    def read(cls, device: torch.device) -> GpuMemory:
        free, total = torch.cuda.mem_get_info(device)
        return cls(total=total, free=free, torch_reserved=torch.cuda.memory_reserved(device))


def gpu_kv_budget(baseline: GpuMemory, after_profile: GpuMemory, peak_allocated: int,
                  utilization: float) -> int:
    """Bytes left for the KV cache: utilization x total, less this process's peak torch
    allocation (weights and activations) and the non-torch memory that appeared since the
    baseline. ValueError, with the numbers, when nothing is left or the GPU is already too full."""
    requested = int(baseline.total * utilization)
    non_torch_increase = max(0, after_profile.non_torch - baseline.non_torch)
    budget = requested - peak_allocated - non_torch_increase
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} gives this instance {requested // _MIB} MiB of the "
            f"GPU's {baseline.total // _MIB} MiB, but the weights and a forward pass of the largest step "
            f"take {peak_allocated // _MIB} MiB (and CUDA {non_torch_increase // _MIB} MiB more): nothing "
            "is left for the KV cache. Raise --gpu-memory-utilization, lower --max-num-batched-tokens, "
            "or use a smaller model")
    if after_profile.free < budget:
        raise ValueError(
            f"the KV cache would take {budget // _MIB} MiB (gpu_memory_utilization={utilization}), but "
            f"only {after_profile.free // _MIB} MiB of the GPU are free: other processes use "
            f"{baseline.non_torch // _MIB} MiB. Lower --gpu-memory-utilization (instances sharing a "
            "GPU must split it) or --kv-cache-memory")
    return budget


def kv_cache_bytes(cache: CacheConfig, device: torch.device, measure_gpu: Callable[[], int]) -> int:
    """The KV cache's byte budget on `device`: `kv_cache_memory` when set, the CPU default, or
    (GPU, not set) `measure_gpu()`, which profiles and applies `gpu_kv_budget`."""
    if cache.kv_cache_memory is not None:
        return cache.kv_cache_memory
    if device.type == "cpu":
        return DEFAULT_CPU_KV_CACHE_MEMORY
    return measure_gpu()

"""How many KV blocks a worker can hold: a byte budget on the CPU, a measurement on a GPU.

On the CPU the budget is `kv_cache_memory` (512MiB when not set). On a GPU it is what vLLM's
`--gpu-memory-utilization` leaves: this instance may use that share of the GPU's total memory,
and the KV cache gets what remains of it after
- the weights and the peak activations of a profiling forward as large as the largest step,
  with the sampler's [rows, vocab] temporaries of its most expensive settings on every row (the
  profile's own temporary KV cache is not counted: it is gone when the real one is allocated);
- the memory CUDA itself took meanwhile (cuBLAS workspaces, the Triton modules loaded);
- where decode steps will run as CUDA graphs, the graphs' private pool, captured only after the
  KV cache is allocated: the activations of a decode step of `max_num_seqs` sequences, measured
  by a second profiling forward, and `GRAPH_CAPTURE_RESERVE` for what capture adds (the capture
  stream's cuBLAS workspace, a decode kernel variant per captured size). The device check logs
  the pool each capture really took beside this reserve.
The profile's cached blocks are released (`empty_cache`) before the reading that decides, so a
share near 1.0 is not refused for memory this process only holds in its cache. The CUDA context,
created before the first measurement, is not counted: the share left over (10% at the default
0.9) covers it. Two instances on one GPU each take their own share (`kvrelay up` splits the
requested one between them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvrelay.config import DEFAULT_CPU_KV_CACHE_MEMORY, CacheConfig
from kvrelay.kv_transfer.config import KVTransferConfig

_MIB = 1024**2
GRAPH_CAPTURE_RESERVE = 64 * _MIB  # a reserve, not a measurement: see the module docstring


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
                  utilization: float, *, profile_kv_bytes: int = 0, graph_bytes: int = 0) -> int:
    """Bytes left for the KV cache: utilization x total, less this process's peak torch
    allocation (weights and activations; the profile's temporary KV cache of `profile_kv_bytes`
    taken out), the non-torch memory that appeared since the baseline and the CUDA graphs'
    `graph_bytes`. ValueError, with the numbers, when nothing is left or the GPU is already too
    full."""
    requested = int(baseline.total * utilization)
    non_torch_increase = max(0, after_profile.non_torch - baseline.non_torch)
    steady = peak_allocated - profile_kv_bytes
    budget = requested - steady - non_torch_increase - graph_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} gives this instance {requested // _MIB} MiB of the "
            f"GPU's {baseline.total // _MIB} MiB, but the weights and a forward pass of the largest step "
            f"take {steady // _MIB} MiB (and CUDA {non_torch_increase // _MIB} MiB more, the CUDA graphs "
            f"{graph_bytes // _MIB} MiB): nothing is left for the KV cache. Raise --gpu-memory-utilization, "
            "lower --max-num-batched-tokens or --max-num-seqs, or use a smaller model")
    if after_profile.free < budget + graph_bytes:
        raise ValueError(
            f"the KV cache would take {budget // _MIB} MiB and the CUDA graphs {graph_bytes // _MIB} MiB "
            f"(gpu_memory_utilization={utilization}), but only {after_profile.free // _MIB} MiB of the GPU "
            f"are free: other processes use {baseline.non_torch // _MIB} MiB. Lower "
            "--gpu-memory-utilization (instances sharing a GPU must split it) or --kv-cache-memory")
    return budget


class Profiled(Protocol):
    """What the budget measures: the model runner before its KV cache exists."""

    @property
    def captures_graphs(self) -> bool: ...

    def profile_forward(self, num_tokens: int, num_seqs: int, sample: bool = True) -> int: ...


def measure_gpu_kv_budget(runner: Profiled, device: torch.device, baseline: GpuMemory, utilization: float,
                          max_num_batched_tokens: int, max_num_seqs: int) -> tuple[int, int]:
    """Profile the largest step (and, with CUDA graphs, a decode step of max_num_seqs) on
    `device` and apply `gpu_kv_budget`. Returns (KV cache bytes, the CUDA graphs' reserve)."""
    torch.cuda.reset_peak_memory_stats(device)
    profile_kv = runner.profile_forward(max_num_batched_tokens, max_num_seqs)
    peak = torch.cuda.max_memory_allocated(device)
    graph_bytes = 0
    if runner.captures_graphs:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        decode_kv = runner.profile_forward(max_num_seqs, max_num_seqs, sample=False)
        graph_bytes = torch.cuda.max_memory_allocated(device) - before - decode_kv + GRAPH_CAPTURE_RESERVE
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # NOTE: before the reading: the profile's cached blocks are free for the KV
    budget = gpu_kv_budget(baseline, GpuMemory.read(device), peak, utilization, profile_kv_bytes=profile_kv,
                           graph_bytes=graph_bytes)
    return budget, graph_bytes


def kv_cache_bytes(cache: CacheConfig, device: torch.device, measure_gpu: Callable[[], int],
                   cap: int | None = None) -> int:
    """The KV cache's byte budget on `device`: `kv_cache_memory` when set, the CPU default, or
    (GPU, not set) `measure_gpu()`, which profiles and applies `gpu_kv_budget`; at most `cap`
    (`host_staging_bound`) when given."""
    if cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
    elif device.type == "cpu":
        budget = DEFAULT_CPU_KV_CACHE_MEMORY
    else:
        budget = measure_gpu()
    return budget if cap is None else min(budget, cap)


def host_staging_bound(transfer: KVTransferConfig | None, device: torch.device, tp_size: int) -> int | None:
    """The cap on the KV cache of a GPU instance whose connector stages KV through a pinned host
    mirror of the whole pool (kv_buffer_device "cpu"): the mirror's bound. None where nothing is
    staged."""
    if (transfer is None or transfer.kv_connector is None or transfer.kv_buffer_device != "cpu"
            or device.type != "cuda"):
        return None
    from kvrelay.kv_transfer.transport.staging import mirror_bound

    return mirror_bound(transfer.kv_buffer_size, tp_size)

"""The KV cache's byte budget: kv_cache_memory, the CPU default, or measured on a GPU."""

from __future__ import annotations

import pytest
import torch

from kvrelay.config import DEFAULT_CPU_KV_CACHE_MEMORY, CacheConfig
from kvrelay.worker.memory import GpuMemory, gpu_kv_budget, kv_cache_bytes

GIB = 1024**3


def never() -> int:
    raise AssertionError("the GPU was measured where it must not be")


def test_an_explicit_kv_cache_memory_wins_on_every_device() -> None:
    cache = CacheConfig(kv_cache_memory="3GiB")
    assert kv_cache_bytes(cache, torch.device("cpu"), never) == 3 * GIB
    assert kv_cache_bytes(cache, torch.device("cuda"), never) == 3 * GIB


def test_the_cpu_default_is_512_mib_and_a_gpu_is_measured() -> None:
    assert DEFAULT_CPU_KV_CACHE_MEMORY == 512 * 1024**2
    assert kv_cache_bytes(CacheConfig(), torch.device("cpu"), never) == DEFAULT_CPU_KV_CACHE_MEMORY
    assert kv_cache_bytes(CacheConfig(), torch.device("cuda"), lambda: 7) == 7


def test_the_gpu_budget_is_the_share_less_weights_activations_and_new_non_torch_memory() -> None:
    baseline = GpuMemory(total=100 * GIB, free=99 * GIB, torch_reserved=0)  # 1 GiB: the CUDA context
    # After the weights and a profiling forward: torch holds 12 GiB (peak allocated 10), and CUDA
    # libraries took 2 GiB more outside torch.
    after = GpuMemory(total=100 * GIB, free=85 * GIB, torch_reserved=12 * GIB)
    assert after.non_torch == 3 * GIB
    budget = gpu_kv_budget(baseline, after, peak_allocated=10 * GIB, utilization=0.9)
    assert budget == 90 * GIB - 10 * GIB - 2 * GIB


def test_two_instances_sharing_a_gpu_each_get_their_share() -> None:
    first = gpu_kv_budget(GpuMemory(100 * GIB, 99 * GIB, 0), GpuMemory(100 * GIB, 94 * GIB, 5 * GIB),
                          5 * GIB, 0.45)
    # The second starts beside the first, which already holds its 45 GiB.
    second_baseline = GpuMemory(100 * GIB, 54 * GIB, 0)
    second = gpu_kv_budget(second_baseline, GpuMemory(100 * GIB, 49 * GIB, 5 * GIB), 5 * GIB, 0.45)
    assert first == second == 45 * GIB - 5 * GIB


def test_a_share_the_weights_alone_exceed_is_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match="gives this instance 10240 MiB .* take 15360 MiB"):
        gpu_kv_budget(GpuMemory(100 * GIB, 99 * GIB, 0), GpuMemory(100 * GIB, 84 * GIB, 15 * GIB),
                      15 * GIB, 0.1)


def test_a_gpu_already_full_of_other_processes_is_refused() -> None:
    baseline = GpuMemory(total=100 * GIB, free=20 * GIB, torch_reserved=0)  # others hold 80 GiB
    with pytest.raises(ValueError, match="only 15360 MiB of the GPU are free: other processes use 81920 MiB"):
        gpu_kv_budget(baseline, GpuMemory(100 * GIB, 15 * GIB, 5 * GIB), 5 * GIB, 0.9)

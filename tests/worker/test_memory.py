"""The KV cache's byte budget: kv_cache_memory, the CPU default, or measured on a GPU."""

from __future__ import annotations

import pytest
import torch

from kvrelay.config import DEFAULT_CPU_KV_CACHE_MEMORY, CacheConfig
from kvrelay.worker.memory import (
    GRAPH_CAPTURE_RESERVE,
    GpuMemory,
    gpu_kv_budget,
    host_staging_bound,
    kv_cache_bytes,
    measure_gpu_kv_budget,
)

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


def test_the_profile_s_temporary_kv_is_not_counted_and_the_cuda_graphs_are() -> None:
    baseline = GpuMemory(total=100 * GIB, free=99 * GIB, torch_reserved=0)
    after = GpuMemory(total=100 * GIB, free=89 * GIB, torch_reserved=10 * GIB)  # nothing new outside torch
    budget = gpu_kv_budget(baseline, after, 14 * GIB, 0.9, profile_kv_bytes=4 * GIB, graph_bytes=GIB)
    assert budget == 90 * GIB - (14 - 4) * GIB - GIB


def test_a_kv_cache_and_graphs_that_fit_only_together_are_refused_naming_both() -> None:
    baseline = GpuMemory(total=100 * GIB, free=89 * GIB, torch_reserved=0)  # others hold 11 GiB
    after = GpuMemory(total=100 * GIB, free=84 * GIB, torch_reserved=5 * GIB)  # the KV's 83 GiB would fit
    with pytest.raises(ValueError, match="CUDA graphs 2048 MiB .* only 86016 MiB of the GPU are free"):
        gpu_kv_budget(baseline, after, 5 * GIB, 0.9, graph_bytes=2 * GIB)


class FakeGpu:
    """torch.cuda's memory counters for one process, and the order they were read in."""

    def __init__(self, total: int, weights: int) -> None:
        self.total, self.allocated, self.peak, self.reserved = total, weights, weights, weights
        self.calls: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("reset_peak_memory_stats", "max_memory_allocated", "memory_allocated", "memory_reserved",
                     "mem_get_info", "synchronize", "empty_cache"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated)  # the allocator keeps what it got

    def reset_peak_memory_stats(self, device: object = None) -> None:
        self.peak = self.allocated

    def max_memory_allocated(self, device: object = None) -> int:
        return self.peak

    def memory_allocated(self, device: object = None) -> int:
        return self.allocated

    def memory_reserved(self, device: object = None) -> int:
        return self.reserved

    def mem_get_info(self, device: object = None) -> tuple[int, int]:
        self.calls.append("mem_get_info")
        return self.total - self.reserved, self.total

    def synchronize(self, device: object = None) -> None:
        pass

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.reserved = self.allocated


class ProfiledRunner:
    """A model runner whose profiles allocate a temporary KV cache, activations and, when it
    samples, the sampler's temporaries, and free them again."""

    def __init__(self, gpu: FakeGpu, captures_graphs: bool) -> None:
        self.gpu, self.captures_graphs = gpu, captures_graphs
        self.profiles: list[tuple[int, int, bool]] = []

    def profile_forward(self, num_tokens: int, num_seqs: int, sample: bool = True) -> int:
        self.profiles.append((num_tokens, num_seqs, sample))
        kv, activations, sampler = num_tokens * 1000, num_tokens * 300, num_seqs * 50 if sample else 0
        self.gpu.allocate(kv + activations)
        self.gpu.allocate(sampler)
        self.gpu.allocate(-(kv + activations + sampler))
        return kv


@pytest.mark.parametrize("captures_graphs", [True, False])
def test_the_measured_budget_leaves_out_the_profile_s_kv_and_keeps_the_graphs_decode_activations(
        monkeypatch: pytest.MonkeyPatch, captures_graphs: bool) -> None:
    gpu = FakeGpu(total=100 * GIB, weights=5 * GIB)
    gpu.install(monkeypatch)
    runner = ProfiledRunner(gpu, captures_graphs)
    baseline = GpuMemory(total=100 * GIB, free=100 * GIB, torch_reserved=0)
    budget, graph_bytes = measure_gpu_kv_budget(runner, torch.device("cuda"), baseline, 0.9, 8192, 256)
    steady = 5 * GIB + 8192 * 300 + 256 * 50  # weights, the largest step's activations, the sampler's
    expected_graphs = 256 * 300 + GRAPH_CAPTURE_RESERVE if captures_graphs else 0
    assert graph_bytes == expected_graphs
    assert budget == int(100 * GIB * 0.9) - steady - expected_graphs
    assert runner.profiles == [(8192, 256, True)] + ([(256, 256, False)] if captures_graphs else [])
    # The profile's cached blocks are handed back before the reading that decides.
    assert gpu.calls == ["empty_cache", "mem_get_info"]


def test_a_share_near_1_fits_once_the_profile_s_cache_is_released(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGpu(total=100 * GIB, weights=5 * GIB)
    gpu.install(monkeypatch)
    runner = ProfiledRunner(gpu, captures_graphs=False)
    runner.profile_forward = lambda n, s, sample=True: (gpu.allocate(30 * GIB), gpu.allocate(-30 * GIB), 0)[2]
    budget, _ = measure_gpu_kv_budget(runner, torch.device("cuda"), GpuMemory(100 * GIB, 100 * GIB, 0), 0.99,
                                      8192, 1)
    assert budget == int(100 * GIB * 0.99) - 35 * GIB  # the 30 GiB cached by the profile counted free


def test_a_gpu_instance_that_stages_its_kv_caps_it_at_the_host_mirror_s_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrelay.kv_transfer.config import KVTransferConfig
    from kvrelay.kv_transfer.transport import staging

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    staged = KVTransferConfig(kv_connector="NixlConnector", kv_buffer_device="cpu", kv_buffer_size=2 * GIB)
    assert host_staging_bound(staged, cuda, 1) == 2 * GIB
    monkeypatch.setattr(staging, "available_host_memory", lambda: 100 * GIB)
    by_host = KVTransferConfig(kv_connector="NixlConnector", kv_buffer_device="cpu")
    assert host_staging_bound(by_host, cuda, 2) == 25 * GIB  # half the host, over two TP ranks
    for unstaged, device in [(staged, cpu), (KVTransferConfig(kv_connector="NixlConnector"), cuda),
                             (KVTransferConfig(kv_buffer_device="cpu"), cuda), (None, cuda)]:
        assert host_staging_bound(unstaged, device, 1) is None
    assert kv_cache_bytes(CacheConfig(), cuda, lambda: 70 * GIB, cap=2 * GIB) == 2 * GIB
    assert kv_cache_bytes(CacheConfig(), cuda, lambda: GIB, cap=2 * GIB) == GIB


def test_the_host_s_available_memory_is_read_from_the_system() -> None:
    from kvrelay.kv_transfer.transport.staging import available_host_memory

    assert 0 < available_host_memory() < 1 << 50

"""The model runner's KV cache allocation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvrelay.worker.model_runner import _zeros_on_huge_pages


def _vm_flags_at(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (Linux /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_kv_cache_memory_is_zeroed_and_asks_for_huge_pages() -> None:
    shape = (700, 2, 3, 16, 64)  # ~17 MB: several whole 2 MB pages inside
    cache = _zeros_on_huge_pages(shape, torch.float32, torch.device("cpu"))
    assert cache.shape == shape and cache.dtype == torch.float32 and cache.is_contiguous()
    assert not cache.any()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if sys.platform != "linux" or not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("no transparent huge pages here")
    middle = cache.data_ptr() + cache.numel() * cache.element_size() // 2
    assert "hg" in _vm_flags_at(middle), "madvise(MADV_HUGEPAGE) was applied to the cache"


def test_small_or_non_cpu_caches_are_plain_zeros() -> None:
    cache = _zeros_on_huge_pages((3, 2, 1, 4, 8), torch.float16, torch.device("meta"))
    assert cache.shape == (3, 2, 1, 4, 8) and cache.device.type == "meta"
    tiny = _zeros_on_huge_pages((1, 2, 1, 4, 8), torch.float32, torch.device("cpu"))  # < one 2 MB page
    assert not tiny.any()


def test_bind_device_makes_a_cuda_device_the_thread_s_current_one_and_leaves_the_cpu_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrelay.worker.model_runner import bind_device

    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    bind_device(torch.device("cuda", 1))
    bind_device(torch.device("cpu"))
    assert calls == [torch.device("cuda", 1)]


def test_the_memory_profile_samples_every_row_and_reports_its_temporary_kv_cache(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrelay import LLM
    from kvrelay.model.sampler import Sampler
    from tests.tiny import tiny_loaded_model

    llm = LLM(loaded_model=tiny_loaded_model("llama", head_dim=16), num_blocks=16, block_size=4)
    runner = llm.engine.runner
    calls: list[int] = []
    sample = Sampler.__call__
    monkeypatch.setattr(Sampler, "__call__", lambda self, logits, rows: (calls.append(len(rows)),
                                                                         sample(self, logits, rows))[1])
    per_block = sum(c[0].numel() * c.element_size() for c in runner.kv_caches.values())
    assert runner.profile_forward(10, 3) == 3 * per_block  # 4, 3 and 3 tokens: a block each
    assert runner.profile_forward(12, 2) == 4 * per_block  # 6 and 6 tokens: two blocks each
    assert runner.profile_forward(3, 3, sample=False) == 3 * per_block
    assert calls == [3, 2]
    llm.shutdown()

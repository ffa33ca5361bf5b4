"""Which device each tensor-parallel rank of an instance runs on."""

from __future__ import annotations

import pytest
import torch

from kvrelay.distributed.parallel_state import rank_device


def test_every_rank_of_a_cpu_instance_runs_on_the_cpu() -> None:
    assert rank_device("cpu", 0) == rank_device("cpu", 3) == torch.device("cpu")


def test_each_rank_of_a_gpu_instance_takes_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [rank_device("cuda", r) for r in range(2)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert rank_device("cuda:2", 1) == torch.device("cuda", 3)


def test_a_rank_past_the_last_gpu_is_refused_naming_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="rank 1 of an instance on cuda needs cuda:1, but this machine has"):
        rank_device("cuda", 1)

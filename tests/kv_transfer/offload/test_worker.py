"""The offload worker's step-side pieces that need no store."""

from __future__ import annotations

import pytest
import torch

from kvrelay.kv_transfer.offload.worker import block_index


def test_a_store_s_block_index_is_pinned_for_gpu_kv_so_its_copy_does_not_wait_for_the_forward(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pinned: list[list[int]] = []

    def pin_memory(tensor: torch.Tensor) -> torch.Tensor:  # a CPU-only torch cannot pin
        pinned.append(tensor.tolist())
        return tensor

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    index = block_index([3, 1, 7], pinned=True)
    assert index.dtype == torch.int64 and index.tolist() == [3, 1, 7] and pinned == [[3, 1, 7]]
    assert block_index([2], pinned=False).tolist() == [2] and pinned == [[3, 1, 7]]

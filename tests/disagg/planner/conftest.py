"""Shared builders: a profile with round numbers, so simulated times can be worked out by hand."""

from __future__ import annotations

import pytest

from kvrelay.disagg.planner.profile import Profile, StepFit, TransferFit

MIB = 2**20


def hand_profile(num_blocks: int = 1000, budget: int = 2048, max_num_seqs: int = 64) -> Profile:
    """Prefill step = 10 ms + 1 ms per token; decode step = 5 ms flat; a transfer = 2 ms + 0.5 ms
    per MiB, and one token of KV is 1 MiB; blocks of 16 tokens."""
    return Profile(
        model="hand", engine={"block_size": 16, "num_blocks": num_blocks, "kv_bytes_per_token": MIB,
                              "max_num_batched_tokens": budget, "max_num_seqs": max_num_seqs},
        prefill=StepFit(10.0, 1.0, 0.0, 0.0), decode=StepFit(5.0, 0.0, 0.0, 0.0),
        transfer={"tcp": TransferFit(2.0, 0.5)})


@pytest.fixture
def profile() -> Profile:
    return hand_profile()

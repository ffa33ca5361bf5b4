"""benchmarks/floors.py: the FLOPs it counts for a workload, and the peak FMA rate it measures."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.tiny import tiny_loaded_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import floors  # noqa: E402


def test_workload_flops_counts_layers_lm_head_and_causal_attention() -> None:
    spec = replace(tiny_loaded_model().spec, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                   num_kv_heads=1, head_dim=4, vocab_size=10)
    # Per layer: qkv 8 x (8 + 2 * 4), o 8 x 8, gate/up/down 3 x 8 x 16: 128 + 64 + 384 = 576 weights.
    per_token = 2 * 2 * 576
    lm_head = 2 * 8 * 10
    per_pair = 4 * 2 * 2 * 4  # QK^T and PV, 2 heads of 4, 2 layers
    # A 3-token prompt and 2 outputs: 4 tokens go through the layers (the last output never does),
    # 1 + 2 + 3 + 4 = 10 causal pairs, 2 LM-head rows.
    assert floors.workload_flops(spec, [(3, 2)]) == 4 * per_token + 2 * lm_head + 10 * per_pair
    assert floors.workload_flops(spec, [(3, 2), (3, 2)]) == 2 * floors.workload_flops(spec, [(3, 2)])


def test_fma_peak_builds_and_gives_a_plausible_rate_and_floor() -> None:
    one = floors.fma_peak(1, reps=2)
    if one is None:
        pytest.skip("no C compiler")
    assert one > 1e9  # any x86-64 core does more than a GFLOP/s of vector FMAs
    floor = floors.compute_floor(tiny_loaded_model().spec, [(16, 4)], threads=1)
    assert floor is not None and floor.seconds > 0 and floor.work > 0


def test_notes_name_each_floor_and_the_ratio_it_allows_against_vllm() -> None:
    spec = tiny_loaded_model().spec
    lines = floors.notes(spec, 1, single_tokens=4, single_vllm=1.0, mixed=[(16, 4)], mixed_vllm=1.0)
    assert len(lines) == 2
    assert lines[0].startswith("single-stream floor: 4 steps") and lines[0].endswith("x vLLM")
    assert lines[1].startswith("mixed-workload floor:") and lines[1].endswith("x vLLM")
    assert floors.notes(spec, 1, single_tokens=0, single_vllm=None, mixed=[], mixed_vllm=None) == []

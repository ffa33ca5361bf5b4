"""`kvrelay up --device`: which GPUs (or the CPU) each instance gets, and what share of their memory.

plan_devices is pure: these run on any machine. Where LocalCluster is involved, the GPUs it sees are
patched in (`visible_gpus`), so no test needs one.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from kvrelay.disagg.connector_plans import plan_example_connector
from kvrelay.disagg.launcher import ClusterSpec, LocalCluster, serve_argv
from kvrelay.disagg.placement import Placement, plan_devices, startup_waves

PD = [("prefill-0", 1), ("decode-0", 1)]


def test_one_gpu_two_instances_share_it_and_split_the_memory_share() -> None:
    prefill, decode = plan_devices(["0"], PD, "cuda", 0.9)
    assert prefill.gpus == decode.gpus == ("0",)
    assert prefill.gpu_memory_utilization == decode.gpu_memory_utilization == 0.45
    assert prefill.env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert prefill.serve_args == ("--device", "cuda", "--gpu-memory-utilization", "0.45")


def test_two_gpus_two_instances_get_one_each_with_the_whole_share() -> None:
    prefill, decode = plan_devices(["0", "1"], PD, "auto", 0.9)
    assert (prefill.gpus, decode.gpus) == (("0",), ("1",))
    assert prefill.gpu_memory_utilization == decode.gpu_memory_utilization == 0.9
    assert decode.env == {"CUDA_VISIBLE_DEVICES": "1"}  # the child's ranks use cuda:0.. of what it sees


def test_four_gpus_two_tp2_instances_get_two_gpus_each() -> None:
    prefill, decode = plan_devices(["0", "1", "2", "3"], [("prefill-0", 2), ("decode-0", 2)], "cuda", 0.8)
    assert (prefill.gpus, decode.gpus) == (("0", "1"), ("2", "3"))
    assert prefill.env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert prefill.gpu_memory_utilization == decode.gpu_memory_utilization == 0.8


def test_an_instance_with_more_ranks_than_gpus_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match=r"decode-0 has tensor-parallel size 4, but --device cuda gives 2 "
                                         r"GPU\(s\).*--decode-tp"):
        plan_devices(["0", "1"], [("prefill-0", 2), ("decode-0", 4)], "cuda", 0.9)
    with pytest.raises(ValueError, match="prefill-0 has tensor-parallel size 2, but --device cuda:1 gives 1"):
        plan_devices(["0", "1"], [("prefill-0", 2)], "cuda:1", 0.9)


@pytest.mark.parametrize("num_gpus, instances", [
    (2, [("prefill-0", 1), ("decode-0", 1), ("decode-1", 1)]),
    (2, [("prefill-0", 2), ("decode-0", 1)]),
    (3, [("prefill-0", 2), ("prefill-1", 1), ("decode-0", 2), ("decode-1", 1)]),
    (1, [(f"decode-{i}", 1) for i in range(7)]),
])
def test_instances_sharing_a_gpu_stay_under_the_requested_share_together(
        num_gpus: int, instances: list[tuple[str, int]]) -> None:
    placements = plan_devices([str(i) for i in range(num_gpus)], instances, "cuda", 0.9)
    on_gpu: dict[str, float] = defaultdict(float)
    for placement, (_, tp) in zip(placements, instances, strict=True):
        assert len(placement.gpus) == tp and len(set(placement.gpus)) == tp
        for gpu in placement.gpus:
            on_gpu[gpu] += placement.gpu_memory_utilization or 0.0
    assert set(on_gpu) == {str(i) for i in range(num_gpus)}  # every GPU is used
    assert all(0 < share <= 0.9 for share in on_gpu.values()), on_gpu


def test_instances_sharing_a_gpu_start_one_after_the_other_and_the_rest_at_once() -> None:
    def names(waves: list[list[Placement]]) -> list[list[str]]:
        return [[p.name for p in wave] for wave in waves]

    assert names(startup_waves(plan_devices([], PD, "auto", 0.9))) == [["prefill-0", "decode-0"]]
    assert names(startup_waves(plan_devices(["0", "1"], PD, "cuda", 0.9))) == [["prefill-0", "decode-0"]]
    assert names(startup_waves(plan_devices(["0"], PD, "cuda", 0.9))) == [["prefill-0"], ["decode-0"]]
    three = [("prefill-0", 1), ("decode-0", 1), ("decode-1", 1)]  # decode-1 shares GPU 0 with prefill-0
    assert names(startup_waves(plan_devices(["0", "1"], three, "cuda", 0.9))) == [["prefill-0", "decode-0"],
                                                                                  ["decode-1"]]


def test_cuda_n_puts_every_instance_on_that_gpu_as_the_parent_sees_it() -> None:
    # The parent runs with CUDA_VISIBLE_DEVICES=2,3: its cuda:1 is the machine's GPU 3.
    placements = plan_devices(["2", "3"], PD, "cuda:1", 0.9)
    assert all(p.env == {"CUDA_VISIBLE_DEVICES": "3"} for p in placements)
    assert all(p.gpu_memory_utilization == 0.45 for p in placements)


@pytest.mark.parametrize("gpus, device, message", [
    ([], "cuda", "asks for a GPU, but this machine shows none; use --device cpu"),
    ([], "cuda:0", "asks for a GPU"),
    (["0"], "cuda:2", r"this machine has 1 GPU\(s\), cuda:0..cuda:0"),
    (["0"], "tpu", "device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    (["0"], "auto:1", "got 'auto:1'"),
])
def test_a_device_this_machine_lacks_is_refused(gpus: list[str], device: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_devices(gpus, PD, device, 0.9)


def test_on_the_cpu_auto_changes_nothing_and_cpu_is_said_explicitly() -> None:
    for placement in plan_devices([], PD, "auto", 0.9):  # a CPU machine: today's children exactly
        assert (placement.serve_args, placement.env, placement.describe()) == ((), {}, "CPU")
    for placement in plan_devices(["0", "1"], PD, "cpu", 0.5):  # GPUs present, but not wanted
        assert (placement.serve_args, placement.env) == (("--device", "cpu"), {})


def test_up_device_cpu_children_are_todays_plus_device_cpu(tmp_path: Path) -> None:
    spec = ClusterSpec(model="/m", threads_per_instance=2, serve_args=("--max-num-seqs", "4"), device="cpu")
    cluster = LocalCluster(spec)
    assert [p.name for p in cluster.placements] == ["prefill-0", "decode-0"]
    child = cluster._instance(cluster.placements[0], plan_example_connector(tmp_path), tmp_path)
    assert child.argv[:5] == [sys.executable, "-m", "kvrelay.entrypoints.cli", "serve", "/m"]
    assert child.argv[-4:] == ["--max-num-seqs", "4", "--device", "cpu"]
    assert child.env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")  # untouched


def test_up_device_auto_on_a_cpu_machine_builds_the_argv_of_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvrelay.disagg.launcher.visible_gpus", lambda: [])
    spec = ClusterSpec(model="/m", threads_per_instance=2, serve_args=("--max-num-seqs", "4"))
    cluster = LocalCluster(spec)
    assert all(p == Placement(p.name, None) for p in cluster.placements)
    config = {"kv_role": "kv_producer"}
    placed = serve_argv(spec, 8123, config, 1, cluster.placements[0].serve_args)
    assert placed == serve_argv(spec, 8123, config)


def test_up_on_one_gpu_gives_each_child_the_gpu_and_half_the_share(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    monkeypatch.setattr("kvrelay.disagg.launcher.visible_gpus", lambda: ["0"])
    cluster = LocalCluster(ClusterSpec(threads_per_instance=1, gpu_memory_utilization=0.6))
    plan = plan_example_connector(tmp_path)
    for placement in cluster.placements:
        child = cluster._instance(placement, plan, tmp_path)
        assert child.env["CUDA_VISIBLE_DEVICES"] == "0" and child.env["OMP_NUM_THREADS"] == "1"
        assert child.argv[-4:] == ["--device", "cuda", "--gpu-memory-utilization", "0.3"]
    assert cluster.placements[1].describe() == "GPU 0, gpu-memory-utilization 0.3"


def test_up_refuses_a_tp_instance_larger_than_the_gpus_before_starting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvrelay.disagg.launcher.visible_gpus", lambda: ["0"])
    with pytest.raises(ValueError, match="prefill-0 has tensor-parallel size 2"):
        LocalCluster(ClusterSpec(prefill_tp=2))
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 1.5"):
        ClusterSpec(gpu_memory_utilization=1.5)


"""Which transfer path GPU instances get (fastest working first), and how `kvrelay up` passes it
on. No GPU needed: the placements' GPUs and UCX's state are given."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrelay.disagg import launcher
from kvrelay.disagg.connector_plans import kv_transfer_config
from kvrelay.disagg.launcher import ClusterSpec, LocalCluster, connector_plan
from kvrelay.kv_transfer.path_choice import choose_transfer_path
from kvrelay.kv_transfer.transport import ucx_diag
from kvrelay.kv_transfer.transport.ucx_diag import UcxFacts

NO_UCX_CUDA = (False, "libcuda.so.1: cannot open shared object file")
UCX_CUDA = (True, "")


def test_instances_that_see_the_same_gpu_copy_through_cuda_ipc() -> None:
    choice = choose_transfer_path([("0",), ("0",)], None, True, NO_UCX_CUDA)
    assert (choice.backend, choice.kv_buffer_device) == ("cuda_ipc", "cuda")
    assert "GPU(s) 0" in choice.describe()


def test_instances_on_different_gpus_take_nixl_on_vram_where_ucx_has_cuda() -> None:
    choice = choose_transfer_path([("0",), ("1",)], None, True, UCX_CUDA)
    assert (choice.backend, choice.kv_buffer_device) == ("nixl", "cuda")


def test_without_a_cuda_path_they_stage_through_host_memory_saying_why() -> None:
    choice = choose_transfer_path([("0",), ("1",)], None, True, NO_UCX_CUDA)
    assert (choice.backend, choice.kv_buffer_device) == ("nixl", "cpu") and "libcuda.so.1" in choice.reason
    tcp = choose_transfer_path([("0",), ("1",)], None, False, NO_UCX_CUDA)
    assert (tcp.backend, tcp.kv_buffer_device) == ("tcp", "cpu") and "NIXL is not installed" in tcp.reason
    push = choose_transfer_path([("0",), ("1",)], None, True, NO_UCX_CUDA, push=True)
    assert push.kv_buffer_device == "cuda" and "push mode cannot stage" in push.reason


def test_a_named_backend_is_kept_and_host_only_ones_are_staged_on_gpus() -> None:
    assert choose_transfer_path([("0",), ("1",)], "tcp", True, UCX_CUDA).kv_buffer_device == "cpu"
    assert choose_transfer_path([("0",), ("1",)], "nixl", True, UCX_CUDA).kv_buffer_device == "cuda"
    assert choose_transfer_path([("0",), ("0",)], "cuda_ipc", True, UCX_CUDA).backend == "cuda_ipc"
    with pytest.raises(ValueError, match="cuda_ipc needs every instance to see the same GPU"):
        choose_transfer_path([("0",), ("1",)], "cuda_ipc", True, UCX_CUDA)


def test_on_the_cpu_nothing_changes() -> None:
    choice = choose_transfer_path([(), ()], None, False, NO_UCX_CUDA)
    assert (choice.backend, choice.kv_buffer_device) == ("tcp", "cuda")


def test_up_on_one_gpu_gives_every_instance_cuda_ipc(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(launcher, "visible_gpus", lambda: ["0"])
    cluster = LocalCluster(ClusterSpec(device="cuda", port=0))
    assert cluster.transfer_path is not None and cluster.transfer_path.backend == "cuda_ipc"
    plan = connector_plan(cluster.spec, tmp_path, cluster.transfer_path)
    config = kv_transfer_config("NixlConnector", "kv_consumer", "e", 14580, plan, "127.0.0.1")
    assert config["kv_connector_extra_config"]["backend"] == "cuda_ipc" and "kv_buffer_device" not in config


def test_up_on_two_gpus_without_ucx_cuda_stages_and_offload_children_get_it_too(monkeypatch,
                                                                                tmp_path: Path) -> None:
    monkeypatch.setattr(launcher, "visible_gpus", lambda: ["0", "1"])
    monkeypatch.setattr(ucx_diag, "ucx_facts", lambda: UcxFacts(None, (), "no UCX module directory", None))
    cluster = LocalCluster(ClusterSpec(device="cuda", port=0, kv_backend="tcp"))
    assert cluster.transfer_path is not None
    plan = connector_plan(cluster.spec, tmp_path, cluster.transfer_path)
    config = kv_transfer_config("NixlConnector", "kv_consumer", "e", 14580, plan, "127.0.0.1",
                                offload={"cpu_bytes": "1GiB"})
    assert config["kv_buffer_device"] == "cpu"
    assert config["kv_connector_extra_config"]["connectors"][0]["kv_buffer_device"] == "cpu"


def test_up_on_the_cpu_keeps_the_plan_as_it_was(tmp_path: Path) -> None:
    cluster = LocalCluster(ClusterSpec(device="cpu", port=0))
    assert cluster.transfer_path is None
    assert connector_plan(cluster.spec, tmp_path, None).transfer_fields == {}

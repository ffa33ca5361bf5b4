"""`kvrelay up --offload`: decode instances run NixlConnector and OffloadConnector together."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvrelay.config import EngineConfig
from kvrelay.disagg.connector_plans import ConnectorPlan, kv_transfer_config
from kvrelay.disagg.launcher import ClusterSpec, LocalCluster
from kvrelay.disagg.launcher_cli import offload_config
from kvrelay.kv_transfer.base import KVCacheSpec, KVConnectorRole
from kvrelay.kv_transfer.config import KVTransferConfig
from kvrelay.kv_transfer.factory import get_connector_class
from tests.disagg.test_pd_e2e import SERVE_ARGS, completion, metrics, wait_for_blocks_freed
from tests.tiny import write_tiny_model_dir


def _args(**kw: object) -> argparse.Namespace:
    base = dict(offload=False, offload_cpu_bytes=None, offload_disk_dir=None, offload_disk_bytes=None,
                offload_remote_url=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_offload_flags_build_the_offload_connector_config(tmp_path: Path) -> None:
    assert offload_config(_args()) is None
    assert offload_config(_args(offload=True)) == {"cpu_bytes": "1GiB"}
    disk = offload_config(_args(offload_disk_dir=str(tmp_path), offload_disk_bytes="2GiB"))
    assert disk == {"disk_dir": str(tmp_path), "disk_bytes": "2GiB"}


def test_decode_config_is_a_multiconnector_of_nixl_then_offload(tmp_path: Path) -> None:
    plan = ConnectorPlan({"backend": "tcp"})
    config = kv_transfer_config("NixlConnector", "kv_consumer", "d-0", 15000, plan, "127.0.0.1",
                                {"cpu_bytes": "64MiB"})
    parsed = KVTransferConfig.from_any(config)
    assert parsed.kv_connector == "MultiConnector" and parsed.engine_id == "d-0"
    children = parsed.kv_connector_extra_config["connectors"]
    assert [c["kv_connector"] for c in children] == ["NixlConnector", "OffloadConnector"]
    # The composed config builds a real connector (scheduler side: no threads, no torch).
    spec = KVCacheSpec(block_size=16, num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")
    connector = get_connector_class(parsed)(EngineConfig(kv_transfer=parsed), KVConnectorRole.SCHEDULER, spec)
    connector.shutdown()
    assert kv_transfer_config("NixlConnector", "kv_producer", "p-0", 15001, plan, "127.0.0.1") == {
        "kv_connector": "NixlConnector", "kv_role": "kv_producer", "engine_id": "p-0",
        "kv_ip": "127.0.0.1", "kv_port": 15001, "kv_connector_extra_config": {"backend": "tcp"}}


def test_up_with_offload_serves_through_the_proxy_and_leaks_nothing(tmp_path: Path) -> None:
    model_dir = write_tiny_model_dir(tmp_path / "model")
    spec = ClusterSpec(model=str(model_dir), port=0, threads_per_instance=1, serve_args=SERVE_ARGS,
                       startup_timeout=180, grace_period=10, offload={"cpu_bytes": "64MiB"})
    prompt = " ".join(f"t{(5 * i) % 250 + 2}" for i in range(40))
    with LocalCluster(spec) as cluster:
        assert completion(cluster.url, prompt)
        (p,), (d,) = cluster.prefill, cluster.decode
        assert metrics(d.url)["kvrelay_prompt_tokens_external_total"] == 39  # pulled from P
        assert wait_for_blocks_freed([p.url, d.url]) == {p.url: 0, d.url: 0}

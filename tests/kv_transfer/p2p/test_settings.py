"""Both P2P connectors build their transport from the same settings: what a user configures for
the backend reaches the transport whichever connector (pull or push) and role asks for it."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay.kv_transfer import KVConnectorRole, create_connector
from kvrelay.kv_transfer import transport as transport_package
from tests.kv_transfer.builders import engine_config, kv_caches, kv_spec
from tests.kv_transfer.p2p.fake_transport import InProcessTransport
from tests.kv_transfer.p2p.pd import free_port


@pytest.mark.parametrize("connector", ["NixlConnector", "NixlPushConnector"])
@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_mooncake_protocol_and_device_reach_the_transport_of_every_p2p_connector(
        monkeypatch: pytest.MonkeyPatch, connector: str, role: str) -> None:
    asked: list[tuple[str, dict[str, Any]]] = []

    def create_transport(name: str, engine_id: str, host: str = "127.0.0.1",
                         **options: Any) -> InProcessTransport:
        asked.append((name, options))
        return InProcessTransport()

    monkeypatch.setattr(transport_package, "create_transport", create_transport)
    config = engine_config({"kv_connector": connector, "kv_role": role, "kv_port": free_port(),
                            "kv_connector_extra_config": {"backend": "mooncake", "mooncake_protocol": "rdma",
                                                          "mooncake_device": "mlx5_0"}})
    spec = kv_spec()
    worker = create_connector(config, KVConnectorRole.WORKER, spec)
    try:
        worker.register_kv_caches(kv_caches(spec, random=False))
    finally:
        worker.shutdown()
    assert len(asked) == 3  # the start-up loopback check's pair, then the connector's own
    for name, options in asked:
        assert name == "mooncake"
        assert options["protocol"] == "rdma"
        assert options["device_name"] == "mlx5_0"

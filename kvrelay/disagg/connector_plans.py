"""How `kvrelay up` links its P and D instances: one small plan per KV connector (the extra config
it gives every instance, the environment the children need, pull or push), and each instance's
--kv-transfer-config built from it."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KV_SECRET_ENV = "KVRELAY_KV_SECRET"


@dataclass(frozen=True)
class ConnectorPlan:
    """What a connector needs from the launcher, shared by every instance of the cluster."""

    extra_config: dict[str, Any]  # kv_connector_extra_config, identical for P and D
    env: dict[str, str] = field(default_factory=dict)  # extra environment of every serve child
    transfer_mode: str = "pull"  # "push": the proxy starts both legs at once (push_mode.py)


def plan_example_connector(workdir: Path) -> ConnectorPlan:
    """ExampleConnector: P writes block-aligned prompt prefixes to a directory, D reads them."""
    storage = workdir / "kv"
    storage.mkdir(parents=True, exist_ok=True)
    return ConnectorPlan({"shared_storage_path": str(storage)})


def plan_nixl_connector(workdir: Path) -> ConnectorPlan:
    """NixlConnector: D pulls blocks from P (NIXL where installed, else the built-in TCP
    transport); the side channel is authenticated by a secret made for this cluster."""
    from kvrelay.kv_transfer.transport import default_transport

    return ConnectorPlan({"backend": default_transport(), "lease_seconds": 30.0},
                         env={KV_SECRET_ENV: secrets.token_hex(32)})


def plan_nixl_push_connector(workdir: Path) -> ConnectorPlan:
    """NixlPushConnector: P writes into blocks D registered, layer by layer while it computes;
    the proxy sends both legs at once and tells D where P's side channel is."""
    return dataclasses.replace(plan_nixl_connector(workdir), transfer_mode="push")


CONNECTOR_PLANS: dict[str, Callable[[Path], ConnectorPlan]] = {
    "ExampleConnector": plan_example_connector,
    "SharedStorageConnector": plan_example_connector,
    "NixlConnector": plan_nixl_connector,
    "NixlPushConnector": plan_nixl_push_connector,
}
DEFAULT_CONNECTOR = "NixlConnector"


def kv_transfer_config(connector: str, role: str, engine_id: str, kv_port: int,
                       plan: ConnectorPlan, host: str,
                       offload: dict[str, Any] | None = None) -> dict[str, Any]:
    """One instance's --kv-transfer-config (vLLM's field names). With `offload` (an
    OffloadConnector extra config) the instance runs a MultiConnector: the P/D connector first,
    so requests that carry kv_transfer_params load from P; the offload tiers serve and store
    every other prefix."""
    config = {"kv_connector": connector, "kv_role": role, "engine_id": engine_id, "kv_ip": host,
              "kv_port": kv_port, "kv_connector_extra_config": plan.extra_config}
    if offload is None:
        return config
    children = [{"kv_connector": connector, "kv_connector_extra_config": plan.extra_config},
                {"kv_connector": "OffloadConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": offload}]
    return {**config, "kv_connector": "MultiConnector",
            "kv_connector_extra_config": {"connectors": children}}

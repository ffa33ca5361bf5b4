"""How `kvrelay up` links its P and D instances: one small plan per KV connector (the extra config
it gives every instance, the environment the children need, pull or push), and each instance's
--kv-transfer-config built from it."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrelay.kv_transfer.path_choice import PathChoice

KV_SECRET_ENV = "KVRELAY_KV_SECRET"


@dataclass(frozen=True)
class ConnectorPlan:
    """What a connector needs from the launcher, shared by every instance of the cluster."""

    extra_config: dict[str, Any]  # kv_connector_extra_config, identical for P and D
    env: dict[str, str] = field(default_factory=dict)  # extra environment of every serve child
    transfer_mode: str = "pull"  # "push": the proxy starts both legs at once (push_mode.py)
    transfer_fields: dict[str, Any] = field(default_factory=dict)  # top-level, e.g. kv_buffer_device


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
P2P_CONNECTORS = ("NixlConnector", "NixlPushConnector")


def transfer_path(connector: str, gpu_sets: list[tuple[str, ...]],
                  requested_backend: str | None) -> PathChoice | None:
    """For P2P connectors on GPUs: the fastest working path (kvrelay/kv_transfer/path_choice.py);
    None elsewhere (the plan's own default, as on the CPU)."""
    if connector not in P2P_CONNECTORS or not gpu_sets or not all(gpu_sets):
        return None
    from kvrelay.kv_transfer.path_choice import choose_transfer_path
    from kvrelay.kv_transfer.transport import nixl_installed
    from kvrelay.kv_transfer.transport.ucx_diag import ucx_facts

    facts = ucx_facts()
    return choose_transfer_path(gpu_sets, requested_backend, nixl_installed(),
                                (facts.cuda_transports, facts.cause()), push=connector == "NixlPushConnector")


def with_transfer_path(plan: ConnectorPlan, path: PathChoice) -> ConnectorPlan:
    """`plan` moving KV the way `path` says (its backend, and host staging where chosen)."""
    fields = {"kv_buffer_device": "cpu"} if path.kv_buffer_device == "cpu" else {}
    return dataclasses.replace(plan, extra_config={**plan.extra_config, "backend": path.backend},
                               transfer_fields={**plan.transfer_fields, **fields})


def kv_transfer_config(connector: str, role: str, engine_id: str, kv_port: int,
                       plan: ConnectorPlan, host: str,
                       offload: dict[str, Any] | None = None) -> dict[str, Any]:
    """One instance's --kv-transfer-config (vLLM's field names). With `offload` (an
    OffloadConnector extra config) the instance runs a MultiConnector: the P/D connector first,
    so requests that carry kv_transfer_params load from P; the offload tiers serve and store
    every other prefix."""
    config = {"kv_connector": connector, "kv_role": role, "engine_id": engine_id, "kv_ip": host,
              "kv_port": kv_port, "kv_connector_extra_config": plan.extra_config, **plan.transfer_fields}
    if offload is None:
        return config
    children = [{"kv_connector": connector, "kv_connector_extra_config": plan.extra_config,
                 **plan.transfer_fields},
                {"kv_connector": "OffloadConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": offload}]
    return {**config, "kv_connector": "MultiConnector",
            "kv_connector_extra_config": {"connectors": children}}

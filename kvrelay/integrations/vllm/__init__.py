"""kvrelay's KV connectors as vLLM KV connectors (docs/vllm.md).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvrelayConnector",
        "kv_connector_module_path": "kvrelay.integrations.vllm", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"backend": "tcp"}}'

    KvrelayConnector         P/D pull: kvrelay's NixlConnector (backends nixl, tcp, mooncake; leases,
                             heartbeats, signed params, checksums)
    KvrelayPushConnector     P/D push: kvrelay's NixlPushConnector (P writes into D's blocks)
    KvrelayOffloadConnector  the offload tiers (cpu, disk, redis://, mooncakestore://), keyed by
                             vLLM's block hashes so that instances of one model share prefixes

Each is a thin `KVConnectorBase_V1` subclass that translates vLLM's objects (its Request,
KVCacheBlocks, SchedulerOutput, KV tensors, connector output) into kvrelay's own connector of the
same role and back (connectors.py); kvrelay decides everything.

Importing this package is cheap and imports no vLLM: vLLM imports the module in its API-server
process too, and the `vllm.general_plugins` entry point (`register`) runs in every vLLM process.
The connector classes are built on first access (they subclass vLLM's base class, so that access
imports vLLM); a vLLM other than SUPPORTED_VLLM_VERSIONS is refused when a connector starts.
"""

from __future__ import annotations

from typing import Any

from kvrelay.integrations.vllm.version import SUPPORTED_VLLM_VERSIONS

# The connector names vLLM learns from `register` (also the class names in this module).
CONNECTOR_NAMES = ("KvrelayConnector", "KvrelayOffloadConnector", "KvrelayPushConnector")

__all__ = [*CONNECTOR_NAMES, "CONNECTOR_NAMES", "SUPPORTED_VLLM_VERSIONS", "register"]


def register() -> None:
    """The `vllm.general_plugins` entry point: make kvrelay's names known to vLLM's connector
    factory, so `"kv_connector": "KvrelayConnector"` works without `kv_connector_module_path`
    and inside MultiConnector, whose stats are rebuilt by name in vLLM's front end.

    Runs in every vLLM process, also where kvrelay's connectors are not used, so it never raises:
    a vLLM it cannot register with is logged, and a connector refuses it when it starts."""
    from kvrelay.integrations.vllm.version import register_names

    register_names(CONNECTOR_NAMES, __name__)


def __getattr__(name: str) -> Any:
    # NOTE: PEP 562. The classes subclass vLLM's KVConnectorBase_V1: importing them imports vLLM,
    # so they are built when first asked for (by vLLM's factory), never at import.
    if name in CONNECTOR_NAMES:
        from kvrelay.integrations.vllm import connectors

        return getattr(connectors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

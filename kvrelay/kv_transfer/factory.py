"""Connector registry: a name maps to a (module, class) pair that is imported only when used.

A transport library (NIXL, UCX, Redis, ...) is imported by its connector's module, so a lazy
registry keeps every other engine from importing or even needing it.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING

from kvrelay.kv_transfer.base import KVCacheSpec, KVConnectorBase, KVConnectorRole
from kvrelay.kv_transfer.config import KVTransferConfig

if TYPE_CHECKING:
    from kvrelay.config import EngineConfig

# NOTE: the registry itself is the module's only mutable state; the built-in connectors are
# added below and register_connector adds more.
_registry: dict[str, tuple[str, str]] = {}


def register_connector(name: str, module_path: str, class_name: str) -> None:
    """Make `name` select `class_name` from `module_path` (imported at creation, not now)."""
    existing = _registry.get(name)
    if existing is not None and existing != (module_path, class_name):
        raise ValueError(f"connector {name!r} is already registered as {existing[0]}.{existing[1]}")
    _registry[name] = (module_path, class_name)


def registered_connectors() -> list[str]:
    return sorted(_registry)


def get_connector_class(transfer_config: KVTransferConfig) -> type[KVConnectorBase]:
    """Resolve the class a config names, importing only its module."""
    name = transfer_config.kv_connector
    if name is None:
        raise ValueError("kv_transfer_config has no kv_connector: nothing to create")
    if transfer_config.kv_connector_module_path is not None:
        module_path, class_name = transfer_config.kv_connector_module_path, name
    elif name in _registry:
        module_path, class_name = _registry[name]
    else:
        raise ValueError(
            f"unknown kv_connector {name!r}; known connectors: {', '.join(registered_connectors())} "
            "(or set kv_connector_module_path to load a class from your own module)"
        )
    module = importlib.import_module(module_path)
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"module {module_path!r} has no attribute {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise TypeError(f"{module_path}.{class_name} must be a subclass of "
                        f"kvrelay.kv_transfer.KVConnectorBase, got {cls!r}")
    return cls


def create_connector(config: EngineConfig, role: KVConnectorRole, kv_spec: KVCacheSpec) -> KVConnectorBase:
    """Build the connector `config.kv_transfer` names, for one role.

    NOTE: build both roles from the same config object whose `kv_transfer` is already a
    KVTransferConfig: a dict without `engine_id` gets a fresh random id each time it is parsed,
    and the two halves of one engine must agree on it.
    """
    transfer_config = KVTransferConfig.from_any(config.kv_transfer)
    if transfer_config is None:
        raise ValueError("config.kv_transfer is None: no KV connector is configured")
    if transfer_config is not config.kv_transfer:
        config = dataclasses.replace(config, kv_transfer=transfer_config)
    cls = get_connector_class(transfer_config)
    return cls(config, role, kv_spec)


_KV = "kvrelay.kv_transfer"
register_connector("NixlConnector", f"{_KV}.pull.connector", "NixlConnector")
register_connector("NixlPushConnector", f"{_KV}.push.connector", "NixlPushConnector")
register_connector("OffloadConnector", f"{_KV}.offload.connector", "OffloadConnector")
register_connector("ExampleConnector", f"{_KV}.reference.example", "ExampleConnector")
register_connector("SharedStorageConnector", f"{_KV}.reference.example", "ExampleConnector")
register_connector("MultiConnector", f"{_KV}.reference.multi", "MultiConnector")

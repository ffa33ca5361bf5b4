"""KV transfer: the connector contract, its configuration, the factory and the TP aggregator.

Importing this package imports no connector and no torch; `create_connector` imports only the
module of the connector a config names.
"""

from kvrelay.kv_transfer.aggregator import KVOutputAggregator
from kvrelay.kv_transfer.base import (
    LAYER_NAME_FORMAT,
    KVCacheSpec,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    add_stats,
)
from kvrelay.kv_transfer.config import KVTransferConfig
from kvrelay.kv_transfer.factory import (
    create_connector,
    get_connector_class,
    register_connector,
    registered_connectors,
)

__all__ = [
    "LAYER_NAME_FORMAT",
    "KVCacheSpec",
    "KVConnectorBase",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVOutputAggregator",
    "KVTransferConfig",
    "add_stats",
    "create_connector",
    "get_connector_class",
    "register_connector",
    "registered_connectors",
]

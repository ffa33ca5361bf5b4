"""KV transfer: everything that moves KV blocks into or out of an instance.

    base.py         the connector contract (KVConnectorBase, roles, metadata, KVCacheSpec)
    protocols.py    the two halves as the engine sees them, and their null objects
    config.py       KVTransferConfig (vLLM's kv_transfer_config)
    factory.py      connector name -> class, imported only when used
    aggregator.py   merges the workers' connector outputs (tensor parallelism)
    compat.py       which KV two instances can exchange (the compatibility digest)
    side_channel.py authenticated request/reply messages between instances
    wakeup.py       wakes the engine loop when a transfer event arrives
    p2p/            what the pull and push connectors share
    pull/ push/     NixlConnector and NixlPushConnector (P/D disaggregation)
    offload/        OffloadConnector and its storage tiers
    reference/      ExampleConnector and MultiConnector
    transport/      nixl, tcp, mooncake: how the bytes move

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

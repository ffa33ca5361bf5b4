"""KV cache events: which blocks an instance holds, published in vLLM's shape over ZeroMQ.

    config.py         KVEventsConfig (`--kv-events-config`, vLLM's keys)
    events.py         BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch (msgspec)
    base.py           EventPublisher and its null object (what the scheduler sees)
    zmq_publisher.py  ZmqEventPublisher: PUB socket, replay ROUTER, background thread
    subscriber.py     KVEventSubscriber: follows many instances' streams, with replay

The events come from the scheduler side's block pool (kvrelay.core.kv_event_log): one batch per
engine step. Importing this package does not import ZeroMQ.
"""

from kvrelay.kv_events.base import EventPublisher, NullEventPublisher
from kvrelay.kv_events.config import KVEventsConfig
from kvrelay.kv_events.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventPublisher",
    "KVEventBatch",
    "KVEventsConfig",
    "MEDIUM_GPU",
    "NullEventPublisher",
    "decode_batch",
    "encode_batch",
]

"""KV offload: the OffloadConnector stores KV blocks as chunk blobs in tiers (host memory, disk,
Redis or Mooncake Store) and loads a prefix back instead of recomputing it.

    connector.py   OffloadConnector, the facade; scheduler.py and worker.py are its halves
    meta.py        what the scheduler side tells the worker side each step
    lookup.py      which chunks the tiers hold (the scheduler asks the worker's store)
    codec.py       a chunk blob: header, checksum, the blocks' bytes
    store.py       TieredStore: the tiers top-down, with promotion and retries
    tiers/         one module per tier, behind StorageTier
    config.py      the extra config keys (OffloadConfig); stats.py its counters

Importing this package imports neither torch nor the Redis or Mooncake clients.
"""

from __future__ import annotations

from kvrelay.kv_transfer.offload.codec import ChunkError, decode_chunk, encode_chunk, header_size
from kvrelay.kv_transfer.offload.config import OffloadConfig
from kvrelay.kv_transfer.offload.connector import OffloadConnector
from kvrelay.kv_transfer.offload.stats import OffloadStats
from kvrelay.kv_transfer.offload.store import Expected, TieredStore, build_store
from kvrelay.kv_transfer.offload.tiers import CpuTier, DiskTier, StorageTier, TierError, build_tiers

__all__ = [
    "ChunkError",
    "CpuTier",
    "DiskTier",
    "Expected",
    "OffloadConfig",
    "OffloadConnector",
    "OffloadStats",
    "StorageTier",
    "TierError",
    "TieredStore",
    "build_store",
    "build_tiers",
    "decode_chunk",
    "encode_chunk",
    "header_size",
]

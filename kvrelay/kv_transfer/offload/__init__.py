"""Offload storage: tiers of chunk blobs (host memory, disk, Redis or Mooncake Store) behind one
interface.

The OffloadConnector (kvrelay.kv_transfer.connectors.offload) turns KV blocks into chunk blobs
and back; this package only stores blobs: `build_store(config, ...)` makes the tiers an
OffloadConfig names, top-down, inside a TieredStore. Importing it imports neither torch nor
the Redis client.
"""

from __future__ import annotations

from kvrelay.kv_transfer.offload.base import StorageTier, TierError
from kvrelay.kv_transfer.offload.codec import ChunkError, decode_chunk, encode_chunk, header_size
from kvrelay.kv_transfer.offload.config import OffloadConfig
from kvrelay.kv_transfer.offload.cpu import CpuTier
from kvrelay.kv_transfer.offload.disk import DiskTier
from kvrelay.kv_transfer.offload.stats import OffloadStats
from kvrelay.kv_transfer.offload.store import Expected, TieredStore


def build_tiers(config: OffloadConfig, stats: OffloadStats) -> list[StorageTier]:
    """The configured tiers, fastest first: cpu, disk, remote (redis:// or mooncakestore://)."""
    tiers: list[StorageTier] = []
    if config.cpu_bytes:
        tiers.append(CpuTier(config.cpu_bytes, stats))
    if config.disk_dir:
        tiers.append(DiskTier(config.disk_dir, config.disk_bytes, stats))
    if config.remote_url and config.remote_url.startswith("mooncakestore://"):
        from kvrelay.kv_transfer.offload.mooncake_store import MooncakeStoreTier

        tiers.append(MooncakeStoreTier(config.remote_url, stats, ttl_seconds=config.remote_ttl_seconds,
                                       timeout_seconds=config.remote_timeout_seconds))
    elif config.remote_url:
        from kvrelay.kv_transfer.offload.redis import RedisTier

        tiers.append(RedisTier(config.remote_url, stats, ttl_seconds=config.remote_ttl_seconds,
                               timeout_seconds=config.remote_timeout_seconds,
                               write_timeout_seconds=config.remote_write_timeout_seconds))
    return tiers


def build_store(config: OffloadConfig, fingerprint: str, payload_bytes: int,
                stats: OffloadStats, shard: str = "") -> TieredStore:
    return TieredStore(build_tiers(config, stats), fingerprint, payload_bytes, stats,
                       retry_seconds=config.retry_seconds, shard=shard)


__all__ = [
    "ChunkError",
    "CpuTier",
    "DiskTier",
    "Expected",
    "OffloadConfig",
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

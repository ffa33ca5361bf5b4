"""Offload storage tiers: where chunk blobs live (host memory, disk, Redis, Mooncake Store),
each behind `StorageTier` (base.py). `build_tiers` makes the tiers an OffloadConfig names.
Importing this package imports neither torch nor the Redis or Mooncake clients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvrelay.kv_transfer.offload.tiers.base import Blob, StorageTier, TierError
from kvrelay.kv_transfer.offload.tiers.cpu import CpuTier
from kvrelay.kv_transfer.offload.tiers.disk import DiskTier

if TYPE_CHECKING:
    from kvrelay.kv_transfer.offload.config import OffloadConfig
    from kvrelay.kv_transfer.offload.stats import OffloadStats


def build_tiers(config: OffloadConfig, stats: OffloadStats) -> list[StorageTier]:
    """The configured tiers, fastest first: cpu, disk, remote (redis:// or mooncakestore://)."""
    tiers: list[StorageTier] = []
    if config.cpu_bytes:
        tiers.append(CpuTier(config.cpu_bytes, stats))
    if config.disk_dir:
        tiers.append(DiskTier(config.disk_dir, config.disk_bytes, stats))
    if config.remote_url and config.remote_url.startswith("mooncakestore://"):
        from kvrelay.kv_transfer.offload.tiers.mooncake_store import MooncakeStoreTier

        tiers.append(MooncakeStoreTier(config.remote_url, stats, ttl_seconds=config.remote_ttl_seconds,
                                       timeout_seconds=config.remote_timeout_seconds))
    elif config.remote_url:
        from kvrelay.kv_transfer.offload.tiers.redis import RedisTier

        tiers.append(RedisTier(config.remote_url, stats, ttl_seconds=config.remote_ttl_seconds,
                               timeout_seconds=config.remote_timeout_seconds,
                               write_timeout_seconds=config.remote_write_timeout_seconds))
    return tiers


__all__ = ["Blob", "CpuTier", "DiskTier", "StorageTier", "TierError", "build_tiers"]

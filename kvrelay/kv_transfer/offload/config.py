"""OffloadConfig: the OffloadConnector's `kv_connector_extra_config`, parsed and checked once."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvrelay.config import parse_size
from kvrelay.kv_transfer.offload.codec import MAX_TAIL_TOKENS


@dataclass(frozen=True)
class OffloadConfig:
    chunk_tokens: int = 256  # tokens per stored chunk: a whole number of blocks
    cpu_bytes: int = 0  # host-memory tier budget; 0: no cpu tier
    disk_dir: str | None = None  # disk tier directory; None: no disk tier
    disk_bytes: int = 16 * 1024**3  # disk tier budget
    remote_url: str | None = None  # redis://host:port/db or mooncakestore://host:port; None: none
    remote_ttl_seconds: float = 24 * 3600  # TTL of each remote chunk; 0: none
    remote_timeout_seconds: float = 0.5  # socket connect / read timeout for the remote tier
    remote_write_timeout_seconds: float = 5.0  # socket timeout of the background writer's SETs
    retry_seconds: float = 5.0  # a failed remote tier is skipped (a miss) this long
    sync_load_max_tokens: int = 512  # loads up to this size run inside the step; larger: async
    max_pending_stores: int = 16  # chunks copied out and not yet written; more are dropped

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any], block_size: int) -> OffloadConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"OffloadConnector: unknown kv_connector_extra_config key(s) "
                             f"{', '.join(map(repr, unknown))}; known keys: {', '.join(sorted(known))}")
        values = dict(extra)
        for key in ("cpu_bytes", "disk_bytes"):
            if key in values:
                values[key] = parse_size(values[key], key)
        config = cls(**values)
        config.check(block_size)
        return config

    def check(self, block_size: int) -> None:
        if self.chunk_tokens <= 0 or self.chunk_tokens % block_size:
            raise ValueError(f"chunk_tokens must be a positive multiple of block_size={block_size}, "
                             f"got {self.chunk_tokens}")
        if self.chunk_tokens > MAX_TAIL_TOKENS + 1:  # a tail is at most chunk_tokens - 1 tokens
            raise ValueError(f"chunk_tokens must be <= {MAX_TAIL_TOKENS + 1} (a stored tail records its "
                             f"token count in 16 bits), got {self.chunk_tokens}")
        if not (self.cpu_bytes or self.disk_dir or self.remote_url):
            raise ValueError("OffloadConnector needs at least one tier in kv_connector_extra_config: "
                             "cpu_bytes (e.g. '4GiB'), disk_dir (+ disk_bytes) or remote_url "
                             "(redis://host:port/db or mooncakestore://host:port)")
        if self.cpu_bytes < 0 or self.disk_bytes <= 0:
            raise ValueError(f"cpu_bytes must be >= 0 and disk_bytes > 0, got {self.cpu_bytes}, "
                             f"{self.disk_bytes}")
        if self.max_pending_stores < 1 or self.sync_load_max_tokens < 0:
            raise ValueError(f"max_pending_stores must be >= 1 and sync_load_max_tokens >= 0, got "
                             f"{self.max_pending_stores}, {self.sync_load_max_tokens}")
        if (self.remote_timeout_seconds <= 0 or self.remote_write_timeout_seconds <= 0
                or self.retry_seconds < 0 or self.remote_ttl_seconds < 0):
            raise ValueError(f"remote_timeout_seconds and remote_write_timeout_seconds must be > 0, "
                             f"retry_seconds and remote_ttl_seconds >= 0, got {self.remote_timeout_seconds}, "
                             f"{self.remote_write_timeout_seconds}, {self.retry_seconds}, "
                             f"{self.remote_ttl_seconds}")

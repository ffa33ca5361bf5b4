"""The remote tier: chunk blobs as raw Redis string values, with a TTL, via the `redis` client.

    remote_url = "redis://host:port/db"      key "kvrelay:kv:<chunk key>", value the blob

Several instances pointing at one Redis share their prefixes. Redis does its own eviction
(configure `maxmemory` + `allkeys-lru` on the server); the TTL bounds how long a chunk lives.
Short socket timeouts keep a dead or slow server from stalling the engine: any error is raised
as TierError, which the store counts and turns into a miss. Writes get their own connection with
a longer timeout: they run on the background writer, which may wait for CPU time (it runs when
the model's threads leave some, see offload/worker.py), and a write it was too starved to finish
must not read as a dead server.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvrelay.kv_transfer.offload.stats import OffloadStats
from kvrelay.kv_transfer.offload.tiers.base import Blob, StorageTier, TierError

KEY_PREFIX = "kvrelay:kv:"


class RedisTier(StorageTier):
    name = "redis"
    remote = True

    def __init__(self, url: str, stats: OffloadStats, ttl_seconds: float = 0,
                 timeout_seconds: float = 0.5, write_timeout_seconds: float = 5.0) -> None:
        super().__init__(stats)
        try:
            import redis  # the client library: imported only when a remote tier is configured
        except ImportError as e:
            raise ImportError("remote_url needs the `redis` Python package: pip install redis") from e
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"remote_url must look like redis://host:port/db, got {url!r}")
        self.url = url
        self.ttl_ms = int(ttl_seconds * 1000) or None
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._client: Any = redis.Redis.from_url(
            url, socket_timeout=timeout_seconds, socket_connect_timeout=timeout_seconds,
            health_check_interval=0, retry_on_timeout=False)
        self._writer: Any = redis.Redis.from_url(
            url, socket_timeout=write_timeout_seconds, socket_connect_timeout=timeout_seconds,
            health_check_interval=0, retry_on_timeout=False)

    def _call(self, what: str, run: Any) -> Any:
        try:
            return run()
        except self._errors as e:
            raise TierError(f"redis tier {self.url}: {what} failed: {type(e).__name__}: {e}") from e

    def contains(self, keys: Sequence[str]) -> list[bool]:
        def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(KEY_PREFIX + key)
            return list(pipe.execute())
        return [bool(n) for n in self._call("EXISTS", run)]

    def get(self, keys: Sequence[str]) -> list[Blob | None]:
        if not keys:
            return []
        blobs = self._call("MGET", lambda: self._client.mget([KEY_PREFIX + k for k in keys]))
        self.stats.add("offload_redis_bytes_read", sum(len(b) for b in blobs if b is not None))
        return list(blobs)

    def put(self, items: Sequence[tuple[str, Blob]]) -> None:
        def run() -> None:
            pipe = self._writer.pipeline(transaction=False)
            for key, blob in items:
                # NOTE: a memoryview is sent without a copy (the client rejects bytearray).
                pipe.set(KEY_PREFIX + key, memoryview(blob), px=self.ttl_ms)
            pipe.execute()
        self._call("SET", run)
        self.stats.add("offload_redis_bytes_written", sum(len(b) for _, b in items))

    def remove(self, keys: Sequence[str]) -> None:
        if keys:
            self._call("DEL", lambda: self._client.delete(*[KEY_PREFIX + k for k in keys]))

    def close(self) -> None:
        for client in (self._client, self._writer):
            try:
                client.close()
            except self._errors:
                pass

"""The Mooncake Store tier: chunk blobs as objects of a Mooncake distributed store.

    remote_url = "mooncakestore://HOST:PORT"     the master's RPC address
                 "mooncakestore://HOST:PORT?segment=1GiB&buffer=64MiB&protocol=tcp&device=&local_host=IP"

The master only keeps metadata; the bytes live in segments that the store's clients contribute.
Each kvrelay instance is such a client: it mounts `segment` bytes of its memory into the pool
(0: none, a pure reader/writer of other clients' segments; else at least 16MiB) and transfers
through a `buffer` bytes local buffer, with the Transfer Engine (P2PHANDSHAKE metadata, protocol
tcp, or rdma with `device`). Objects in an instance's segment go away with that instance; the
master evicts the least recently used objects when the pool passes its high watermark.

An object is a 64-byte stamp (magic, expiry in unix ms, 0: none) followed by the chunk blob
(codec.py: its own header and checksum, verified by the TieredStore). The master has no expiry,
so `remote_ttl_seconds` is enforced here: an expired object reads as a miss and is removed.
Reads take the object out of the client's registered buffer and copy it once into memory of
our own (the buffer must be handed back at once: an upper tier may keep the blob).

Failures: a master that is down when the instance starts is not joined (its port is probed
first); the tier misses and is joined on a later call once the port answers. The master down
after joining answers lookups and removals with an error code (TierError: the store
counts it, serves a miss, and skips the tier for retry_seconds), a read with a missing object,
which is then told apart from a true miss by one existence check. The client reconnects by
itself once the master is back; objects the old master knew are gone, new writes refill it.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import numpy as np

from kvrelay.config import parse_size
from kvrelay.kv_transfer.offload.stats import OffloadStats
from kvrelay.kv_transfer.offload.tiers.base import Blob, StorageTier, TierError

logger = logging.getLogger(__name__)

SCHEME = "mooncakestore://"
_STAMP = struct.Struct("<4sQ")  # magic, expiry unix ms (0: never)
_STAMP_BYTES = 64  # keeps the blob (and the tensors viewed over its payload) 64-byte aligned
_MAGIC = b"KVMS"
_NO_SPACE = -200  # the master found no room for a new object (eviction runs in the background)
_NOT_FOUND = -704
_MIN_SEGMENT_BYTES = 16 * 1024**2


@dataclass(frozen=True)
class MooncakeStoreUrl:
    master: str  # host:port
    local_host: str
    segment_bytes: int = 512 * 1024**2
    buffer_bytes: int = 64 * 1024**2
    protocol: str = "tcp"
    device: str = ""


def parse_url(url: str) -> MooncakeStoreUrl:
    """The settings in a mooncakestore:// URL; ValueError naming what is wrong."""
    parts = urlsplit(url)
    if not url.startswith(SCHEME) or not parts.hostname or parts.port is None:
        raise ValueError(f"remote_url must look like mooncakestore://HOST:PORT (the master), got {url!r}")
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    known = {"segment", "buffer", "protocol", "device", "local_host"}
    unknown = sorted(set(query) - known)
    if unknown:
        raise ValueError(f"unknown mooncakestore:// option(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(known))}")
    protocol = query.get("protocol", "tcp")
    if protocol not in ("tcp", "rdma"):
        raise ValueError(f"mooncakestore:// protocol must be tcp or rdma, got {protocol!r}")
    settings = MooncakeStoreUrl(
        master=f"{parts.hostname}:{parts.port}",
        local_host=query.get("local_host") or _local_address_towards(parts.hostname),
        segment_bytes=_size(query.get("segment", "512MiB"), "segment"),
        buffer_bytes=_size(query.get("buffer", "64MiB"), "buffer"),
        protocol=protocol, device=query.get("device", ""))
    if 0 < settings.segment_bytes < _MIN_SEGMENT_BYTES:  # the client refuses smaller segments
        raise ValueError(f"mooncakestore:// segment must be 0 or at least 16MiB, "
                         f"got {settings.segment_bytes}")
    return settings


def _size(value: str, name: str) -> int:
    """parse_size, plus "0" (segment=0: this instance lends no memory to the pool)."""
    return 0 if value.strip() == "0" else parse_size(value, f"mooncakestore:// {name}")


def _local_address_towards(host: str) -> str:
    """This machine's address on the route to `host` (loopback for a loopback master)."""
    try:
        if ipaddress.ip_address(host).is_loopback:
            return "127.0.0.1"
    except ValueError:
        if host == "localhost":
            return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # no packet is sent: this only picks the route
        return str(probe.getsockname()[0])


class _Unreachable(TierError):
    """The master's port does not answer."""


class MooncakeStoreTier(StorageTier):
    name = "mooncake"
    remote = True

    def __init__(self, url: str, stats: OffloadStats, ttl_seconds: float = 0,
                 timeout_seconds: float = 0.5) -> None:
        super().__init__(stats)
        self.settings = parse_url(url)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ImportError(f"remote_url {url!r} needs the Mooncake wheel ({e}): pip install "
                              "'kvrelay[mooncake]' and run scripts/install_mooncake_deps.sh") from e
        self._client_class = MooncakeDistributedStore
        self.url = url
        self.ttl_ms = int(ttl_seconds * 1000)
        self.timeout_seconds = timeout_seconds
        self._lock = threading.Lock()
        self._store: Any = None
        self._closed = False
        try:
            self._connect()
        except _Unreachable as e:  # the instance starts anyway; the store retries the tier later
            logger.warning("%s; starting without the Mooncake tier until it answers", e)

    def _connect(self) -> Any:
        """The store client, joining the master first when not joined yet. The master's port is
        probed before joining: the client's own join waits about 90 s for a master that is down."""
        if self._store is not None:
            return self._store
        with self._lock:
            if self._store is None:
                if self._closed:
                    raise TierError("mooncake tier: closed")
                s = self.settings
                host, _, port = s.master.rpartition(":")
                try:
                    socket.create_connection((host, int(port)), timeout=self.timeout_seconds).close()
                except OSError as e:
                    raise _Unreachable(f"mooncake tier: master {s.master} unreachable ({e})") from None
                store = self._client_class()
                rc = store.setup(s.local_host, "P2PHANDSHAKE", s.segment_bytes, s.buffer_bytes, s.protocol,
                                 s.device, s.master)
                if rc != 0:
                    raise ValueError(f"cannot join the Mooncake store at {s.master} (rc {rc}): is it a "
                                     f"mooncake_master, and is {s.local_host} this machine's address?")
                self._store = store
        return self._store

    def _check(self, what: str, codes: Sequence[int]) -> None:
        bad = [c for c in codes if c < 0]
        if bad:
            raise TierError(f"mooncake tier {self.settings.master}: {what} failed (rc {bad[0]})")

    def contains(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        codes = list(self._connect().batch_is_exist(list(keys)))
        self._check("lookup", codes)
        return [c == 1 for c in codes]

    def get(self, keys: Sequence[str]) -> list[Blob | None]:
        if not keys:
            return []
        handles = self._connect().batch_get_buffer(list(keys))
        blobs: list[Blob | None] = [self._unstamp(key, h) for key, h in zip(keys, handles, strict=True)]
        missing = [key for key, h in zip(keys, handles, strict=True) if h is None]
        if missing:  # a miss, or a master that cannot answer: only the existence check tells
            self._check("read", list(self._connect().batch_is_exist(missing)))
        self.stats.add("offload_mooncake_bytes_read", sum(len(b) for b in blobs if b is not None))
        return blobs

    def _unstamp(self, key: str, handle: Any) -> bytearray | None:
        if handle is None:
            return None
        size = handle.size()
        view = np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(handle.ptr()))  # [size]
        if size < _STAMP_BYTES or _STAMP.unpack_from(view[:_STAMP.size].tobytes())[0] != _MAGIC:
            return bytearray()  # not ours: the store's checksum check calls it corrupt
        expiry_ms = _STAMP.unpack_from(view[:_STAMP.size].tobytes())[1]
        if expiry_ms and expiry_ms < time.time() * 1000:
            self._connect().batch_remove([key], True)
            self.stats.add("offload_mooncake_expired")
            return None
        blob = bytearray(size - _STAMP_BYTES)
        np.frombuffer(blob, dtype=np.uint8)[:] = view[_STAMP_BYTES:]  # one copy, GIL released
        return blob

    def put(self, items: Sequence[tuple[str, Blob]]) -> None:
        expiry_ms = int(time.time() * 1000) + self.ttl_ms if self.ttl_ms else 0
        stamp = _STAMP.pack(_MAGIC, expiry_ms).ljust(_STAMP_BYTES, b"\0")
        for key, blob in items:
            rc = self._connect().upsert_parts(key, stamp, memoryview(blob))
            if rc == _NO_SPACE:  # full until the master's eviction catches up: not a failure
                self.stats.add("offload_mooncake_no_space")
                continue
            self._check("write", [rc])
            self.stats.add("offload_mooncake_bytes_written", len(blob))

    def remove(self, keys: Sequence[str]) -> None:
        if keys:
            # NOTE: force: a read leases an object for a while, and a corrupt one must go now.
            codes = [c for c in self._connect().batch_remove(list(keys), True) if c != _NOT_FOUND]
            self._check("remove", codes)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
        if store is not None:
            store.close()

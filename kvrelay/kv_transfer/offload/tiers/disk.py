"""The disk tier: one file per chunk in `disk_dir`, least recently used evicted past `disk_bytes`.

    DIR/<key>.kvc            a chunk blob (codec.py), written as DIR/.tmp-<key>-<rand> and
                             renamed into place, so a reader never sees a half-written file

A fresh process indexes the directory (oldest modification first), so the tier survives a
restart; a read refreshes the file's mtime so recency survives too. Several processes may share
one directory: a file another process wrote is found by `contains` and indexed then. Each
process enforces the budget on what it has indexed, so a shared directory can briefly exceed it.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from kvrelay.kv_transfer.offload.stats import OffloadStats
from kvrelay.kv_transfer.offload.tiers.base import Blob, StorageTier, TierError
from kvrelay.kv_transfer.offload.tiers.lru import LRUByteIndex

_SUFFIX = ".kvc"
_STALE_TMP_SECONDS = 300  # a temp file this old belongs to a writer that died


class DiskTier(StorageTier):
    name = "disk"

    def __init__(self, directory: str | Path, capacity_bytes: int, stats: OffloadStats) -> None:
        super().__init__(stats)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lru = LRUByteIndex(capacity_bytes)
        self._lock = threading.Lock()
        self._index_directory()

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}{_SUFFIX}"

    def _index_directory(self) -> None:
        now = time.time()
        entries = []
        for entry in os.scandir(self.directory):
            try:
                st = entry.stat()
                if entry.name.startswith(".tmp-") and now - st.st_mtime > _STALE_TMP_SECONDS:
                    os.unlink(entry.path)
                elif entry.name.endswith(_SUFFIX) and entry.is_file():
                    entries.append((st.st_mtime, entry.name[:-len(_SUFFIX)], st.st_size))
            except OSError:
                continue  # removed by another process meanwhile
        with self._lock:
            for _, key, size in sorted(entries):
                self._evict(self._lru.add(key, size), key)

    def keys(self) -> list[str]:
        """Indexed keys, least recently used first."""
        with self._lock:
            return self._lru.keys()

    def contains(self, keys: Sequence[str]) -> list[bool]:
        found = []
        with self._lock:
            for key in keys:
                if key in self._lru:
                    found.append(True)
                    continue
                try:  # written by another process sharing the directory?
                    size = self._path(key).stat().st_size
                except OSError:
                    found.append(False)
                    continue
                self._evict(self._lru.add(key, size), key)
                found.append(key in self._lru)
        return found

    def get(self, keys: Sequence[str]) -> list[Blob | None]:
        return [self._read(key) for key in keys]

    def _read(self, key: str) -> bytearray | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                blob = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(blob)
            os.utime(path)  # recency survives a restart
        except FileNotFoundError:
            with self._lock:
                self._lru.discard(key)
            return None
        except OSError as e:
            raise TierError(f"disk tier: cannot read {path}: {e}") from e
        with self._lock:
            if key in self._lru:
                self._lru.touch(key)
            else:
                self._evict(self._lru.add(key, len(blob)), key)
        self.stats.add("offload_disk_bytes_read", len(blob))
        return blob

    def put(self, items: Sequence[tuple[str, Blob]]) -> None:
        for key, blob in items:
            self._write(key, blob)

    def _write(self, key: str, blob: Blob) -> None:
        tmp = self.directory / f".tmp-{key}-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(key))
        except OSError as e:  # full disk, read-only mount, directory removed
            tmp.unlink(missing_ok=True)
            raise TierError(f"disk tier: cannot write {self._path(key)}: {e}") from e
        with self._lock:
            self._evict(self._lru.add(key, len(blob)), key)
        self.stats.add("offload_disk_bytes_written", len(blob))

    def _evict(self, keys: list[str], keep_unless_too_big: str) -> None:
        """Delete evicted files (the lock is held). Counts evictions of other keys."""
        for key in keys:
            self._path(key).unlink(missing_ok=True)
            if key != keep_unless_too_big:
                self.stats.add("offload_disk_evictions")
        self._evicted(keys)

    def remove(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._lru.discard(key)
                self._path(key).unlink(missing_ok=True)

"""Thread-safe counters for the offload store, handed out as a flat `dict[str, float]`.

Keys (summed across steps and workers, like every connector stat; a "chunk" in them is any
stored entry, a prompt's tail too):

  offload_{tier}_hits / _misses            chunk reads answered / not answered by the tier
  offload_{tier}_bytes_read / _written     blob bytes moved through the tier
  offload_{tier}_evictions                 chunks the tier dropped to stay within its budget
  offload_{tier}_errors                    calls that failed (tier down, full disk, timeout)
  offload_{tier}_corrupt                   blobs whose header or checksum did not match
  offload_promotions                       chunks copied up into a higher tier after a hit
  offload_lookups / offload_lookup_chunks / offload_lookup_hit_chunks
                                           scheduler lookups, chunks asked, chunks found
  offload_chunks_loaded / offload_chunks_load_failed
  offload_tails_loaded / offload_tails_stored
                                           the tails alone (a prompt's tokens past its last
                                           full chunk), loaded / stored
  offload_load_seconds                     summed wall time of load jobs (latency = / loads)
  offload_loads                            load jobs (one per request and step)
  offload_chunks_stored / offload_stores_failed / offload_stores_dropped
  offload_store_seconds                    summed wall time from copy-out to all tiers written
  offload_copy_out_seconds                 time the step spent copying chunks to staging

plus the standard connector keys bytes_loaded, bytes_saved, seconds_loading, seconds_saving,
tokens_loaded, load_failures, save_failures.
"""

from __future__ import annotations

import threading


class OffloadStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, float] = {}

    def add(self, key: str, value: float = 1) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + value

    def add_many(self, values: dict[str, float]) -> None:
        with self._lock:
            for key, value in values.items():
                self._counts[key] = self._counts.get(key, 0) + value

    def take(self) -> dict[str, float]:
        """Everything counted since the previous take."""
        with self._lock:
            counts, self._counts = self._counts, {}
        return counts

"""The OffloadConnector's worker half: chunk bytes in and out of the paged KV tensors.

Loads: a synchronous load is copied into its blocks in start_load_kv; an asynchronous one is
handed to a loader thread, and its request id comes back in finished_recving once every chunk
landed (or in invalid_block_ids from the first chunk that did not).

Stores never block the step on a tier. In wait_for_save each completed chunk is gathered out of
the KV tensors into a staging buffer (one index_select per layer, the only work the step pays
for); a writer thread then checksums it and writes it through the tiers. Copying out inside the
step, rather than keeping the request's blocks pinned (delay_free) until a tier wrote them,
means a block is never read after the scheduler may reuse it, also when a request is preempted
(preemption frees blocks without asking the connector). The staging buffers are a fixed pool
(`max_pending_stores`): when all are in flight a chunk is dropped, never queued without bound.
The writer thread runs on idle CPU time only (SCHED_IDLE), unless its backlog grows past half the
pool: then it competes at the lowest priority until it has caught up.

GPU KV: the staging buffers are pinned, and a store's gather runs on a side stream; the compute
stream waits (on the device, not the host) only for that gather before it may write the blocks
again, while the device -> host copy runs on behind it; the writer thread waits for the copy's
event before it seals the chunk. Loads copy host -> device on the side stream too.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvrelay.attention.kv_format import kv_format
from kvrelay.kv_transfer.offload.codec import header_size, seal_chunk
from kvrelay.kv_transfer.offload.config import OffloadConfig
from kvrelay.kv_transfer.offload.meta import (
    ChunkLoad,
    ChunkSave,
    LoadJob,
    OffloadConnectorMetadata,
)
from kvrelay.kv_transfer.offload.stats import OffloadStats
from kvrelay.kv_transfer.offload.store import Expected, TieredStore
from kvrelay.kv_transfer.transport.streams import CopyEvent, SideStream
from kvrelay.utils import cdiv

if TYPE_CHECKING:
    from kvrelay.kv_transfer.base import KVCacheSpec

logger = logging.getLogger(__name__)

_PENDING_WAIT_SECONDS = 0.005  # how long a "pending" question waits for the writer to drain
_CHUNKS_PER_READ = 4  # chunks fetched per batched tier read (bounds a load's peak memory)


@dataclass
class _Settled:
    """Results of background work not yet reported through get_finished."""

    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)


class OffloadWorker:
    """Owns the store, the staging pool and the two background threads.

    NOTE: the threads run _Background methods, never this object's, so dropping the connector
    lets it be collected and its finalizer stop them (see OffloadConnector).
    """

    def __init__(self, config: OffloadConfig, kv_spec: KVCacheSpec, store: TieredStore,
                 stats: OffloadStats) -> None:
        self.config = config
        self.kv_spec = kv_spec
        self.store = store
        self.stats = stats
        self.blocks_per_chunk = config.chunk_tokens // kv_spec.block_size
        self.background: _Background | None = None
        self._failed_loads: set[str] = set()  # this step's synchronous loads that failed

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        caches = [kv_caches[name] for name in self.kv_spec.layer_names]
        self.background = _Background(self.config, self.kv_spec, self.store, self.stats, caches)

    @property
    def _bg(self) -> _Background:
        if self.background is None:
            raise RuntimeError("OffloadConnector: register_kv_caches was not called")
        return self.background

    def start_load_kv(self, meta: OffloadConnectorMetadata) -> None:
        self._failed_loads = set()
        for job in meta.loads:
            if job.load_async:
                self._bg.submit_load(job)
            elif self._bg.load(job):
                self._failed_loads.add(job.req_id)

    def wait_for_save(self, meta: OffloadConnectorMetadata) -> None:
        # NOTE: a request whose load failed in this step computed its other tokens on top of
        # blocks without valid KV: storing them would publish wrong KV under a valid key.
        saves = [save for save in meta.saves if save.req_id not in self._failed_loads]
        if saves:
            self._bg.copy_out(saves)

    def take_settled(self) -> _Settled:
        return self._bg.take_settled() if self.background is not None else _Settled()

    def answer(self, message: list[object]) -> object:
        """The lookup channel's questions (see kvrelay.kv_transfer.offload.lookup)."""
        if message[0] == "lookup":
            keys = message[1]
            return self.store.lookup(keys) if isinstance(keys, list) else 0
        if message[0] == "pending":
            return self.background.wait_pending(_PENDING_WAIT_SECONDS) if self.background else 0
        if message[0] == "events":
            return self.store.take_events()
        raise ValueError(f"unknown offload lookup message {message[0]!r}")


@dataclass
class _Store:
    """A chunk copied out of the KV cache, on its way to the writer."""

    save: ChunkSave
    blob: memoryview
    staging: bytearray | memoryview
    queued_at: float
    copied: CopyEvent | None = None  # GPU KV: the device -> host copy still to finish
    gathered: list[torch.Tensor] = field(default_factory=list)  # its source, alive until then


def block_index(block_ids: list[int], pinned: bool) -> torch.Tensor:
    """The block ids as an int64 index [n], in pinned host memory for GPU KV: a pageable source
    makes a `non_blocking` copy to the device wait for its stream (here the side stream, which
    has just waited for the whole forward), stalling the step that stores."""
    index = torch.tensor(block_ids, dtype=torch.long)  # [n]
    return index.pin_memory() if pinned else index


class _Background:
    """The loader and writer threads and the state they share with the step."""

    def __init__(self, config: OffloadConfig, kv_spec: KVCacheSpec, store: TieredStore,
                 stats: OffloadStats, caches: list[torch.Tensor]) -> None:
        self.store = store
        self.stats = stats
        # NOTE: fp8 caches are moved as their bytes (torch has no fp8 index_copy on the CPU).
        fmt = kv_format(kv_spec.dtype)
        self.dtype = torch.uint8 if fmt.is_fp8 else fmt.torch_dtype
        self.caches = [c.view(self.dtype) for c in caches]  # per layer [num_blocks, 2, H_kv, block_size, D]
        self.device = caches[0].device
        self.on_gpu = self.device.type == "cuda"
        self.stream = SideStream(str(self.device))
        self.block_size = kv_spec.block_size
        self.blocks_per_chunk = config.chunk_tokens // kv_spec.block_size
        self.fingerprint = kv_spec.fingerprint_digest()
        self.block_shape = tuple(kv_spec.block_shape)  # [2, H_kv, block_size, D]
        self.max_staging = config.max_pending_stores
        # NOTE: chunk keys are 40 hex digits, so every blob's header has the same size.
        self.header_bytes = header_size("0" * 40, self.fingerprint)
        self.payload_bytes = store.payload_bytes
        self.block_payload_bytes = self.payload_bytes // self.blocks_per_chunk  # one block, every layer
        self._free_staging: list[bytearray | memoryview] = []
        self._num_staging = 0
        self._lock = threading.Condition()
        self._pending_stores = 0  # copied out, not yet written
        self._unreported_stores = 0  # written, their stats not yet handed out by get_finished
        self._settled = _Settled()
        self._loads: queue.Queue[LoadJob | None] = queue.Queue()
        self._stores: queue.Queue[_Store | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._load_loop, name="kvrelay-offload-load", daemon=True),
                         threading.Thread(target=self._store_loop, name="kvrelay-offload-store", daemon=True)]
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish what is queued, then end both threads (waits up to `timeout` for them)."""
        self._loads.put(None)
        self._stores.put(None)
        for thread in self._threads:
            if thread is not threading.current_thread():  # a finalizer may run on one of them
                thread.join(timeout)

    # ------------------------------------------------------------------ loads
    def submit_load(self, job: LoadJob) -> None:
        self._loads.put(job)

    def _load_loop(self) -> None:
        while (job := self._loads.get()) is not None:
            invalid = self.load(job, report=False)
            with self._lock:
                self._settled.finished_recving.add(job.req_id)
                self._settled.invalid_block_ids |= invalid
                self._lock.notify_all()

    def entry_blocks(self, tail_tokens: int) -> int:
        """Blocks an entry holds: a full chunk's, or those its tail's tokens span."""
        return cdiv(tail_tokens, self.block_size) if tail_tokens else self.blocks_per_chunk

    def load(self, job: LoadJob, report: bool = True) -> set[int]:
        """Copy a job's entries into their blocks, in order, until one is missing or corrupt;
        returns the blocks left without valid KV (also recorded for get_finished if `report`)."""
        start = time.perf_counter()
        num_loaded = 0
        failed_at = len(job.chunks)
        for first in range(0, len(job.chunks), _CHUNKS_PER_READ):
            group = job.chunks[first:first + _CHUNKS_PER_READ]
            expected = [Expected(self.entry_blocks(c.tail_tokens) * self.block_payload_bytes, c.tail_tokens)
                        for c in group]
            payloads = self.store.get_many([chunk.key for chunk in group], expected)
            for i, (chunk, payload) in enumerate(zip(group, payloads, strict=True)):
                if payload is None:
                    failed_at = first + i
                    break
                self._copy_in(chunk, payload)
                num_loaded += len(chunk.block_ids)
            if failed_at < len(job.chunks):
                break
        invalid = {b for chunk in job.chunks[failed_at:] for b in chunk.block_ids}
        self._count_load(job, num_loaded, len(job.chunks) - failed_at, time.perf_counter() - start)
        if invalid and report:
            with self._lock:
                self._settled.invalid_block_ids |= invalid
        return invalid

    def _copy_in(self, load: ChunkLoad, payload: memoryview) -> None:
        shape = (len(self.caches), self.entry_blocks(load.tail_tokens), *self.block_shape)
        with warnings.catch_warnings():  # the blob may be read-only bytes: it is only read
            warnings.simplefilter("ignore", UserWarning)
            entry = torch.frombuffer(payload, dtype=self.dtype).view(shape)  # [L, blocks, 2, H_kv, bs, D]
        rows = entry[:, load.first_block:load.first_block + len(load.block_ids)]  # [L, n, 2, H_kv, bs, D]
        index = torch.tensor(load.block_ids, dtype=torch.long)
        if self.on_gpu:  # host -> device on the side stream; this thread waits, the compute stream does not
            with self.stream.copying():
                index = index.to(self.device)
                for layer, cache in enumerate(self.caches):
                    cache.index_copy_(0, index, rows[layer].to(self.device))
                self.stream.wait(self.stream.record(), timeout_s=60)
            return
        for layer, cache in enumerate(self.caches):
            cache.index_copy_(0, index, rows[layer])

    def _count_load(self, job: LoadJob, num_blocks: int, num_failed: int, seconds: float) -> None:
        layer_block_bytes = self.caches[0][0].numel() * self.caches[0].element_size()
        num_tails = sum(1 for chunk in job.chunks[:len(job.chunks) - num_failed] if chunk.tail_tokens)
        self.stats.add_many({
            "offload_loads": 1, "offload_load_seconds": seconds, "seconds_loading": seconds,
            "offload_chunks_loaded": len(job.chunks) - num_failed, "offload_tails_loaded": num_tails,
            "offload_chunks_load_failed": num_failed, "load_failures": int(num_failed > 0),
            "bytes_loaded": num_blocks * layer_block_bytes * len(self.caches),
            "tokens_loaded": num_blocks * self.block_size})

    # ------------------------------------------------------------------ stores
    def copy_out(self, saves: list[ChunkSave]) -> None:
        """Gather each entry's blocks into a staging buffer and queue it for the writer (a tail
        fills the front of a buffer: it spans fewer blocks than a chunk)."""
        start = time.perf_counter()
        dropped = 0
        for save in saves:
            staging = self._acquire_staging()
            if staging is None:
                dropped += 1
                continue
            blob = memoryview(staging)[:self.header_bytes + len(save.block_ids) * self.block_payload_bytes]
            entry = self._payload_view(blob, len(save.block_ids))  # [L, n, 2, H_kv, block_size, D]
            index = block_index(save.block_ids, pinned=self.on_gpu)  # [n]
            store = _Store(save, blob, staging, time.perf_counter())
            if self.on_gpu:
                store.copied, store.gathered = self._gather_on_device(entry, index)
            else:
                for layer, cache in enumerate(self.caches):
                    torch.index_select(cache, 0, index, out=entry[layer])
            with self._lock:
                self._pending_stores += 1
            self._stores.put(store)
        self.stats.add_many({"offload_copy_out_seconds": time.perf_counter() - start,
                             "offload_stores_dropped": dropped})
        if dropped:
            self.store.log_rate_limited("dropped", "offload: %d chunk store(s) dropped: %d already in flight "
                            "(raise max_pending_stores?)", dropped, self.max_staging)

    def _gather_on_device(self, entry: torch.Tensor, index: torch.Tensor
                          ) -> tuple[CopyEvent, list[torch.Tensor]]:
        """Gather the blocks on the side stream, then copy them into the pinned `entry`; the
        compute stream waits for the gather alone. Returns the copy's event and the gathered
        tensors (alive until it fired)."""
        with self.stream.copying():
            index = index.to(self.device, non_blocking=True)
            gathered = [torch.index_select(cache, 0, index) for cache in self.caches]  # each [n, 2, H, bs, D]
            gathered_event = self.stream.record()
            for layer, rows in enumerate(gathered):
                entry[layer].copy_(rows, non_blocking=True)
            copied = self.stream.record()
        # NOTE: a device-side wait: the next step may reuse these blocks only after the gather.
        torch.cuda.current_stream(self.device).wait_event(gathered_event)  # type: ignore[arg-type]
        return copied, gathered

    def _acquire_staging(self) -> bytearray | memoryview | None:
        """A blob buffer (header space + payload) from the pool, pinned for GPU KV; None when all
        are in flight."""
        with self._lock:
            if self._free_staging:
                return self._free_staging.pop()
            if self._num_staging >= self.max_staging:
                return None
            self._num_staging += 1
        size = self.header_bytes + self.payload_bytes
        if self.on_gpu:  # NOTE: the numpy view keeps the pinned tensor alive
            return memoryview(torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy())  # type: ignore[arg-type]
        return bytearray(size)

    def _payload_view(self, blob: memoryview, num_blocks: int) -> torch.Tensor:
        payload = torch.frombuffer(blob, dtype=torch.uint8, offset=self.header_bytes)
        return payload.view(self.dtype).view(len(self.caches), num_blocks, *self.block_shape)

    def _store_loop(self) -> None:
        # The writer runs on idle CPU time only: a writer that competes with the model's threads
        # preempts one, and the whole parallel region waits for it. With no idle time left it would
        # starve, so past half the staging pool in backlog it competes (at nice 19) until the
        # backlog is down to a quarter.
        idle = True
        _set_this_thread_priority(idle)
        while (item := self._stores.get()) is not None:
            want_idle = _writer_idles(idle, self._stores.qsize(), self.max_staging)
            if want_idle != idle:
                idle = want_idle
                _set_this_thread_priority(idle)
            save, blob, staging, queued_at = item.save, item.blob, item.staging, item.queued_at
            start = time.perf_counter()
            if item.copied is not None and not self.stream.wait(item.copied, timeout_s=60):
                logger.error("offload: a device -> host copy did not finish in 60 s; storing it anyway")
            item.gathered = []
            try:
                seal_chunk(blob, save.key, self.fingerprint, save.tail_tokens)
                stored = self.store.put(save.key, blob, reused=True)
            finally:
                with self._lock:
                    self._free_staging.append(staging)
            done = time.perf_counter()
            self.stats.add_many({
                "offload_chunks_stored": int(stored),
                "offload_tails_stored": int(stored and save.tail_tokens > 0),
                "offload_stores_failed": int(not stored), "save_failures": int(not stored),
                "bytes_saved": len(save.block_ids) * self.block_payload_bytes if stored else 0,
                "seconds_saving": done - start, "offload_store_seconds": done - queued_at})
            with self._lock:
                self._pending_stores -= 1
                self._unreported_stores += 1
                self._lock.notify_all()

    def wait_pending(self, timeout: float) -> int:
        """Stores in flight or not yet reported, after waiting up to `timeout` for the writer.
        NOTE: a written store stays pending until get_finished handed out its stats, so the
        engine takes one more step and no count is lost when it goes idle."""
        with self._lock:
            self._lock.wait_for(lambda: self._pending_stores == 0, timeout)
            return self._pending_stores + self._unreported_stores

    def wait_idle(self, timeout: float) -> bool:
        """Block until no store is in flight (tests, benchmarks, shutdown)."""
        with self._lock:
            return self._lock.wait_for(lambda: self._pending_stores == 0, timeout)

    def take_settled(self) -> _Settled:
        """What settled since the last call (the caller hands out the stats right after)."""
        with self._lock:
            settled, self._settled = self._settled, _Settled()
            self._unreported_stores = 0
        return settled


def _writer_idles(idle: bool, backlog: int, pool: int) -> bool:
    """Whether the writer should run on idle CPU time only, given whether it does now and how many
    chunks wait behind the one in hand (`backlog`) out of a staging pool of `pool`."""
    return backlog < max(1, pool // 2) if idle else backlog <= pool // 4


def _set_this_thread_priority(idle: bool) -> None:
    """Lower the calling thread's CPU priority (Linux, per thread); `idle` picks how far.

    idle=True: SCHED_IDLE, the thread runs only on CPU time no other thread wants; any thread that
    becomes runnable preempts it at once. idle=False: nice 19, still the lowest share, but it
    competes, so it cannot starve. Where these do not exist this does nothing."""
    tid = threading.get_native_id()
    try:
        if idle:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, 19)
    except (AttributeError, OSError):  # not Linux, or not allowed
        pass

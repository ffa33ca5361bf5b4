"""Host staging (`kv_buffer_device: "cpu"`): GPU KV moved by a transport that reads host memory
(TCP, Mooncake, NIXL on DRAM), through a pinned host mirror of the KV pool.

    P  stage_for_peers(blocks)   device -> host copies of a finished request's blocks, on a side
                                 stream, as soon as its lease starts; a pin waits for them
                                 (wait_staged) before D may read
    D  read_blocks(...)          the inner transport reads P's host mirror into D's; once that is
                                 done, host -> device copies of the blocks read (only the byte
                                 ranges read, for a heterogeneous-TP read) on a side stream; the
                                 read is DONE when they ran

The inner transport sees only host tensors, so it serves and reads exactly as it does on a CPU
instance: its notification (P may free) goes out when the bytes are in D's mirror. Push mode does
not stage yet.

The mirror costs as much pinned host memory as the KV pool, so a GPU instance that stages caps
its KV cache at `mirror_bound` (the transfer config's `kv_buffer_size`, else half the host's
available memory over the instance's TP ranks): pinned memory cannot be swapped, and two
instances each mirroring most of a GPU would take the host down.

A heterogeneous-TP read fills only some byte ranges of each of D's blocks. A range of a pinned
block is a strided host tensor, which torch would copy to a GPU through a pageable temporary (a
synchronous copy): the ranges are gathered into one pinned buffer first, copied over in one
asynchronous DMA and scattered on the device (block_copy.copy_layer_to_device).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvrelay.kv_transfer.transport.base import (
    ByteRange,
    KVTransport,
    RegionLayout,
    TransferHandle,
    TransferState,
    WriteGuard,
    describe_kv_caches,
)
from kvrelay.kv_transfer.transport.block_copy import (
    CopyPlan,
    block_bytes_view,
    copy_layer,
    copy_layer_to_device,
    plan_copies,
)
from kvrelay.kv_transfer.transport.streams import CopyEvent, SideStream

if TYPE_CHECKING:
    import torch


def mirror_bound(kv_buffer_size: float | None, tp_size: int = 1) -> int:
    """Bytes one rank's pinned host mirror may take: `kv_buffer_size` (per rank), else half the
    host memory available now over the instance's `tp_size` ranks."""
    if kv_buffer_size is not None:
        return int(kv_buffer_size)
    return available_host_memory() // 2 // max(1, tp_size)


def available_host_memory() -> int:
    """The host's available memory in bytes (Linux MemAvailable; free pages elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class _StagedRead(TransferHandle):
    """The inner read into the host mirror, then the host -> device copies of its blocks."""

    def __init__(self, transport: StagedTransport, inner: TransferHandle, plan: CopyPlan) -> None:
        self._transport, self._inner, self._plan = transport, inner, plan
        self._copied: CopyEvent | None = None
        self._buffers: list[torch.Tensor] = []  # pinned sources of the copies, until they ran
        self._state = TransferState.PENDING
        self._error: str | None = None

    def poll(self) -> TransferState:
        if self._state != TransferState.PENDING:
            return self._state
        if self._copied is None:
            inner = self._inner.poll()
            if inner == TransferState.ERROR:
                self._state, self._error = inner, self._inner.error
            elif inner == TransferState.DONE:
                self._copied, self._buffers = self._transport._to_device(self._plan)
        if self._copied is not None and self._copied.query():
            self._state, self._buffers = TransferState.DONE, []
        return self._state

    def release(self) -> None:
        """Cancels the inner read where it can; copies already queued still run (poll on)."""
        if self._copied is None:
            self._inner.release()

    @property
    def error(self) -> str | None:
        return self._error


class StagedTransport(KVTransport):
    """`inner` over a pinned host mirror of GPU KV (see the module docstring)."""

    def __init__(self, inner: KVTransport, copy_delay_s: float = 0.0) -> None:
        self.inner = inner
        self.name = inner.name
        self.sees_writes = inner.sees_writes
        self._copy_delay_s = copy_delay_s  # CPU only: a test's slow copy
        self._stream: SideStream | None = None
        self._device_layers: list[torch.Tensor] = []  # per layer, [num_blocks, block_bytes] bytes
        self._host_layers: list[torch.Tensor] = []
        self._staged: dict[int, CopyEvent] = {}  # block id -> the copy that staged it last
        self._lock = threading.Lock()  # _staged: written by the engine thread, read by a pin's
        self.blocks_staged = 0

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> RegionLayout:
        import torch

        device = describe_kv_caches(kv_caches).device
        self._stream = SideStream(device, self._copy_delay_s)
        pin = device.startswith("cuda")
        # NOTE: pinning touches (and locks) every page as it allocates; on the CPU zeros do, so no
        # request's first transfer pays for the page faults.
        new = torch.empty if pin else torch.zeros
        mirror = {name: new(kv.shape, dtype=kv.dtype, pin_memory=pin)  # [num_blocks, 2, H, bs, D]
                  for name, kv in kv_caches.items()}
        self._device_layers = [block_bytes_view(kv) for kv in kv_caches.values()]
        self._host_layers = [block_bytes_view(kv) for kv in mirror.values()]
        return self.inner.register_kv_caches(mirror)

    # ---------------------------------------------------------------- P: stage out

    def stage_for_peers(self, block_ids: Sequence[int]) -> None:
        if not block_ids:
            return
        assert self._stream is not None
        plan = plan_copies(block_ids, block_ids, None, 0, 0)
        with self._stream.copying():
            for host, device in zip(self._host_layers, self._device_layers, strict=True):
                copy_layer(host, device, plan)
            event = self._stream.record()
        with self._lock:
            for block_id in block_ids:
                self._staged[block_id] = event
        self.blocks_staged += len(block_ids)

    def wait_staged(self, block_ids: Sequence[int], timeout_s: float) -> bool:
        assert self._stream is not None
        with self._lock:
            events = [self._staged.get(b) for b in block_ids]
        if any(event is None for event in events):
            return False
        return all(self._stream.wait(event, timeout_s) for event in {id(e): e for e in events}.values()
                   if event is not None)

    # ---------------------------------------------------------------- D: read, then stage in

    def read_blocks(self, remote_engine_id: str, local_block_ids: Sequence[int],
                    remote_block_ids: Sequence[int], notification: bytes,
                    ranges: Sequence[ByteRange] | None = None) -> TransferHandle:
        inner = self.inner.read_blocks(remote_engine_id, local_block_ids, remote_block_ids, notification,
                                       ranges)
        # NOTE: host mirror -> device, block for block and only the bytes the read wrote.
        local_ranges = None if ranges is None else [ByteRange(r[1], r[1], r[2]) for r in ranges]
        block_bytes = self._host_layers[0].shape[1] if self._host_layers else 0
        plan = plan_copies(local_block_ids, local_block_ids, local_ranges, block_bytes, block_bytes)
        return _StagedRead(self, inner, plan)

    def _to_device(self, plan: CopyPlan) -> tuple[CopyEvent, list[torch.Tensor]]:
        """Queue the copies; returns their event and the pinned buffers they read (alive until it
        fired)."""
        assert self._stream is not None
        buffers: list[torch.Tensor] = []
        with self._stream.copying():
            for device, host in zip(self._device_layers, self._host_layers, strict=True):
                buffers += copy_layer_to_device(device, host, plan)
            return self._stream.record(), buffers

    # ---------------------------------------------------------------- the rest is the inner's

    def agent_metadata(self) -> bytes:
        return self.inner.agent_metadata()

    def add_remote(self, remote_engine_id: str, agent_metadata: bytes, layout: RegionLayout) -> None:
        self.inner.add_remote(remote_engine_id, agent_metadata, layout)

    def remove_remote(self, remote_engine_id: str) -> None:
        self.inner.remove_remote(remote_engine_id)

    def set_write_guard(self, guard: WriteGuard | None) -> None:
        self.inner.set_write_guard(guard)

    def expect_remote_access(self, expecting: bool) -> None:
        self.inner.expect_remote_access(expecting)

    def get_notifications(self) -> list[bytes]:
        return self.inner.get_notifications()

    def close(self) -> None:
        self.inner.close()

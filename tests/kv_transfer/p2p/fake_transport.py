"""InProcessTransport: a KVTransport whose peers live in the same process (for fast tests).

It copies blocks tensor to tensor, pairwise, when a read completes, and delivers the read's
notification to the owner. Knobs for fault injection: `read_delay_s` (a read stays PENDING that
long), `fail_reads` (a read ends in ERROR), `corrupt_reads` (the copied blocks are altered).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence

import torch

from kvrelay.kv_transfer.transport.base import (
    ByteRange,
    KVTransport,
    RegionLayout,
    TransferHandle,
    TransferState,
    check_ranges,
)

_agents: dict[bytes, InProcessTransport] = {}  # NOTE: test-only registry of live transports
_agents_lock = threading.Lock()


class _Read(TransferHandle):
    def __init__(self, transport: InProcessTransport, remote: InProcessTransport,
                 local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
                 notification: bytes, ranges: Sequence[ByteRange] | None = None) -> None:
        self._transport = transport
        self._ranges = ranges
        self._remote = remote
        self._pairs = (list(local_block_ids), list(remote_block_ids))
        self._notification = notification
        self._ready_at = time.monotonic() + transport.read_delay_s
        self._state = TransferState.PENDING
        self._error: str | None = None
        transport.reads_started += 1

    def poll(self) -> TransferState:
        if self._state != TransferState.PENDING or time.monotonic() < self._ready_at:
            return self._state
        if self._transport.fail_reads or self._remote.closed:
            self._state, self._error = TransferState.ERROR, "injected read failure"
            return self._state
        local, remote = self._pairs
        for name, kv in self._transport.kv_caches.items():
            src = self._remote.kv_caches[name]  # [num_blocks, 2, H_kv, block_size, D]
            if local and self._ranges is not None:
                self._copy_ranges(kv, src, local, remote)
            elif local:
                blocks = src[torch.tensor(remote)].clone()
                if self._transport.corrupt_reads:
                    blocks[-1].add_(1.0)
                kv[torch.tensor(local)] = blocks
        self._remote.deliver(self._notification)
        self._state = TransferState.DONE
        return self._state

    def _copy_ranges(self, kv: torch.Tensor, src: torch.Tensor, local: list[int], remote: list[int]) -> None:
        assert self._ranges is not None
        dst_bytes = kv.view(kv.shape[0], -1).view(torch.uint8)  # [num_blocks, block_bytes]
        src_bytes = src.view(src.shape[0], -1).view(torch.uint8)  # [num_blocks, block_bytes]
        for r in self._ranges:
            got = src_bytes[remote, r.remote_offset:r.remote_offset + r.length].clone()  # [n, length]
            if self._transport.corrupt_reads:
                got[-1, 0] ^= 0xFF
            dst_bytes[local, r.local_offset:r.local_offset + r.length] = got

    def release(self) -> None:
        if self._state == TransferState.PENDING:
            self._transport.reads_cancelled += 1
        self._state = TransferState.ERROR if self._state == TransferState.PENDING else self._state

    @property
    def error(self) -> str | None:
        return self._error


class InProcessTransport(KVTransport):
    name = "inprocess"

    def __init__(self) -> None:
        self.agent = uuid.uuid4().hex.encode()
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.remotes: dict[str, InProcessTransport] = {}
        self._notifications: list[bytes] = []
        self._lock = threading.Lock()
        self.closed = False
        self.read_delay_s = 0.0
        self.fail_reads = False
        self.corrupt_reads = False
        self.reads_started = 0
        self.reads_cancelled = 0
        with _agents_lock:
            _agents[self.agent] = self

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> RegionLayout:
        self.kv_caches = dict(kv_caches)
        first = next(iter(kv_caches.values()))
        return RegionLayout(layer_names=tuple(kv_caches), num_blocks=first.shape[0],
                            block_bytes=first[0].numel() * first.element_size(),
                            base_addresses=tuple(t.data_ptr() for t in kv_caches.values()))

    def agent_metadata(self) -> bytes:
        return self.agent

    def add_remote(self, remote_engine_id: str, agent_metadata: bytes, layout: RegionLayout) -> None:
        with _agents_lock:
            remote = _agents.get(agent_metadata)
        if remote is None:
            raise ValueError(f"no in-process agent {agent_metadata!r}")
        self.remotes[remote_engine_id] = remote

    def remove_remote(self, remote_engine_id: str) -> None:
        self.remotes.pop(remote_engine_id, None)

    def read_blocks(self, remote_engine_id: str, local_block_ids: Sequence[int],
                    remote_block_ids: Sequence[int], notification: bytes,
                    ranges: Sequence[ByteRange] | None = None) -> TransferHandle:
        remote = self.remotes.get(remote_engine_id)
        if remote is None:
            raise ValueError(f"unknown remote engine {remote_engine_id!r}")
        block_bytes = [next(iter(t.kv_caches.values()))[0].nbytes for t in (self, remote)]
        checked = check_ranges(ranges, *block_bytes)
        return _Read(self, remote, local_block_ids, remote_block_ids, notification, checked)

    def deliver(self, notification: bytes) -> None:
        with self._lock:
            self._notifications.append(notification)

    def get_notifications(self) -> list[bytes]:
        with self._lock:
            notifications, self._notifications = self._notifications, []
        return notifications

    def close(self) -> None:
        self.closed = True
        with _agents_lock:
            _agents.pop(self.agent, None)

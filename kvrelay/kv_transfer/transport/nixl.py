"""The NIXL transport: one-sided READs over UCX (host DRAM here, device memory on a GPU).

Every layer's KV tensor is registered once. Descriptor lists are prepared once per region:
locally at registration, for a peer when it is added, one descriptor per (layer, block):

    descriptor index  l * num_blocks + b   ->   (base_address(l) + b * block_bytes, block_bytes)

so a read only computes two index lists and posts one prepared transfer carrying the
notification. An empty read sends the notification alone. A read by byte ranges (a KV-head slice
of each block, between instances of different TP sizes) builds its own descriptor lists, one
descriptor per (layer, block, range), and posts them unprepared.

NOTE: the agent's own progress thread is off (it busy-polls; on a small machine it costs more
than the transfers). Without RDMA, UCX emulates a READ or WRITE with messages both sides must
serve, so both workers have to be progressed: a light thread here calls get_new_notifs every
`progress_interval_s`, which also collects notifications, and checks every transfer still in
flight. The second matters as much: NIXL sends a transfer's notification from the call that
finds it complete, so a transfer that did not complete inside `transfer()` stays unannounced
to the peer until someone checks it. Before the thread checked them, a layer-wise push whose
engine was busy computing left some layers' writes unannounced for seconds, and the last one
for up to 170 ms after P's last layer (the whole critical path the push exists to hide). The
agent is not thread-safe in this mode, so every agent call holds one lock.

The thread polls every `progress_interval_s` only while something can happen: a transfer of
this side's is in flight, a notification came in the last `_LINGER_S`, or the owner expects
peers to read or write this side's memory (`expect_remote_access`: P while it holds leases, D
while pushes are due). Otherwise it polls every `idle_interval_s`. Polling every 0.5 ms cost an
idle server about 9% of a core, taken from the engine when P and D share a machine. A transport
expects peer access until told otherwise, so one used without a connector (the profiler, the
benchmarks, tests) behaves as before.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvrelay.kv_transfer import wakeup
from kvrelay.kv_transfer.transport.base import (
    ByteRange,
    FinishedTransfer,
    KVTransport,
    RegionLayout,
    TransferHandle,
    TransferState,
    check_compatible,
    check_layers,
    check_ranges,
    check_read,
    check_write_ranges,
    describe_kv_caches,
    range_copies,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def import_nixl() -> Any:
    """The nixl Python API module (`nixl_cu12` wheel, or a `nixl` build); ImportError if absent."""
    try:
        from nixl_cu12 import _api
    except ImportError:
        from nixl import _api  # type: ignore[no-redef]
    return _api


def nixl_available() -> bool:
    try:
        import_nixl()
    except ImportError:
        return False
    return True


def _mem_type(device: str) -> str:
    return "DRAM" if device == "cpu" else "VRAM"


def _device_index(device: str) -> int:
    _, _, index = device.partition(":")
    return int(index) if index else 0


def block_descriptors(layout: RegionLayout) -> np.ndarray:
    """One (address, length, device) row per (layer, block), layer-major."""
    bases = np.array(layout.base_addresses, dtype=np.uint64)  # [L]
    offsets = np.arange(layout.num_blocks, dtype=np.uint64) * np.uint64(layout.block_bytes)  # [N]
    descs = np.empty((len(bases), layout.num_blocks, 3), dtype=np.uint64)  # [L, N, 3]
    descs[:, :, 0] = bases[:, None] + offsets[None, :]
    descs[:, :, 1] = layout.block_bytes
    descs[:, :, 2] = _device_index(layout.device)
    return descs.reshape(-1, 3)  # [L * N, 3]


def descriptor_indices(block_ids: Sequence[int], num_layers: int, num_blocks: int,
                       layers: Sequence[int] | None = None) -> np.ndarray:
    """Indices of `block_ids` in every layer (or the `layers` given) of a layer-major
    descriptor list."""
    ids = np.asarray(block_ids, dtype=np.int64)  # [n]
    chosen = np.arange(num_layers, dtype=np.int64) if layers is None else np.asarray(layers, dtype=np.int64)
    layer_starts = chosen * num_blocks  # [L]
    return (layer_starts[:, None] + ids[None, :]).ravel().astype(np.int32)  # [L * n]


_STATES = {"DONE": TransferState.DONE, "PROC": TransferState.PENDING}  # anything else ("ERR"): ERROR


class _NixlRead(TransferHandle):
    """A posted READ or WRITE. While it is in flight the transport's progress thread checks it
    too (`NixlTransport._advance`), so its notification goes out as soon as it completes."""

    def __init__(self, transport: NixlTransport, xfer: Any, state: str) -> None:
        self._transport = transport
        self._xfer = xfer
        self._state = state
        self._released = False
        self._failure: str | None = None  # what the agent raised when asked, if it did

    def poll(self) -> TransferState:
        if self._state == "PROC":
            with self._transport.lock:
                self._check()
        return _STATES.get(self._state, TransferState.ERROR)

    def _check(self) -> bool:
        """Under the transport's lock: ask the agent again; True once the transfer has ended.
        An agent that raises ends the transfer as failed (the engine recovers per policy) rather
        than raising into the engine's poll or stopping the progress thread's other checks."""
        if self._state == "PROC" and not self._released:
            try:
                self._state = self._transport.agent.check_xfer_state(self._xfer)
            except Exception as e:
                self._state, self._failure = "ERR", f"{type(e).__name__}: {e}"
        return self._state != "PROC" or self._released

    def release(self) -> None:
        if self._released:
            return
        with self._transport.lock:
            self._released = True
            self._transport._in_flight.discard(self)
            try:
                self._xfer.release()
            except Exception as e:  # NIXL refuses to release a transfer it cannot cancel
                logger.warning("NIXL transport: releasing a transfer in state %s failed: %s", self._state, e)

    @property
    def error(self) -> str | None:
        if self._state in ("DONE", "PROC"):
            return None
        if self._failure is not None:
            return f"NIXL transfer failed: checking it raised {self._failure}"
        return f"NIXL transfer failed (state {self._state})"


class _Remote:
    def __init__(self, agent_name: str, layout: RegionLayout, descs: Any) -> None:
        self.agent_name = agent_name
        self.layout = layout
        self.descs = descs  # prepared descriptor list of every (layer, block) of the peer


IDLE_INTERVAL_S = 0.02  # the progress thread's pace while nothing is expected or in flight
_LINGER_S = 0.2  # fast polling kept this long after the last notification or expected access


class NixlTransport(KVTransport):
    """NIXL agent named after `engine_id` (plus a random suffix: a restarted engine is a new
    agent). `progress_interval_s` paces the progress thread; 0 disables it, and then the
    caller must call get_notifications often, even while idle, for peers' reads to progress."""

    name = "nixl"

    def __init__(self, engine_id: str, *, progress_interval_s: float = 0.0005,
                 idle_interval_s: float | None = None, backends: Sequence[str] = ("UCX",)) -> None:
        api = import_nixl()
        self.engine_id = engine_id
        self.agent_name = f"{engine_id}-{uuid.uuid4().hex[:8]}"
        config = api.nixl_agent_config(enable_prog_thread=False, backends=list(backends))
        self.agent = api.nixl_agent(self.agent_name, config)
        self.lock = threading.Lock()
        self.layout: RegionLayout | None = None
        self._kv_caches: list[torch.Tensor] = []
        self._reg_descs: Any = None
        self._local_descs: Any = None
        self._remotes: dict[str, _Remote] = {}
        self._notifications: deque[bytes] = deque()
        self._in_flight: set[_NixlRead] = set()  # posted, not yet seen complete (under self.lock)
        self._closed = False
        self._progress_interval_s = progress_interval_s
        self._idle_interval_s = max(progress_interval_s, IDLE_INTERVAL_S if idle_interval_s is None
                                    else idle_interval_s)
        self._expecting = True  # peers may read or write our memory now (expect_remote_access)
        self._busy_until = 0.0  # time.monotonic() until which the thread polls at the fast pace
        self._kick = threading.Event()  # wakes the progress thread early: something to progress
        self._progress_thread: threading.Thread | None = None
        if progress_interval_s > 0:
            self._progress_thread = threading.Thread(target=self._progress_loop, name="kvrelay-nixl-progress",
                                                     daemon=True)
            self._progress_thread.start()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> RegionLayout:
        layout = describe_kv_caches(kv_caches)
        mem_type = _mem_type(layout.device)
        with self.lock:
            self._reg_descs = self.agent.register_memory(list(kv_caches.values()))
            self._local_descs = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_descriptors(layout),
                                                           mem_type)
        self._kv_caches = list(kv_caches.values())  # NOTE: registered memory must outlive the agent's use
        self.layout = layout
        return layout

    def agent_metadata(self) -> bytes:
        with self.lock:
            return bytes(self.agent.get_agent_metadata())

    def add_remote(self, remote_engine_id: str, agent_metadata: bytes, layout: RegionLayout) -> None:
        if remote_engine_id in self._remotes:
            return
        if self.layout is not None:
            check_compatible(self.layout, layout)
        with self.lock:
            agent_name = self.agent.add_remote_agent(agent_metadata)
            try:
                descs = self.agent.prep_xfer_dlist(agent_name, block_descriptors(layout),
                                                   _mem_type(layout.device))
            except Exception:
                self.agent.remove_remote_agent(agent_name)
                raise
        self._remotes[remote_engine_id] = _Remote(agent_name, layout, descs)

    def remove_remote(self, remote_engine_id: str) -> None:
        remote = self._remotes.pop(remote_engine_id, None)
        if remote is None:
            return
        with self.lock:
            remote.descs.release()
            self.agent.remove_remote_agent(remote.agent_name)

    def read_blocks(self, remote_engine_id: str, local_block_ids: Sequence[int],
                    remote_block_ids: Sequence[int], notification: bytes,
                    ranges: Sequence[ByteRange] | None = None) -> TransferHandle:
        remote = self._remotes.get(remote_engine_id)
        if remote is None:
            return FinishedTransfer(f"unknown remote engine {remote_engine_id!r} (never added or removed)")
        if self.layout is None:
            raise RuntimeError("register_kv_caches must come before read_blocks")
        check_read(local_block_ids, remote_block_ids, self.layout.num_blocks, remote.layout.num_blocks)
        checked = check_ranges(ranges, self.layout.block_bytes, remote.layout.block_bytes)
        if not local_block_ids:
            with self.lock:
                self.agent.send_notif(remote.agent_name, notification)
            return FinishedTransfer()
        if checked is not None:
            return self._ranged("READ", remote, local_block_ids, remote_block_ids, notification, checked,
                                None)
        num_layers = len(self.layout.layer_names)
        local = descriptor_indices(local_block_ids, num_layers, self.layout.num_blocks)
        remote_indices = descriptor_indices(remote_block_ids, num_layers, remote.layout.num_blocks)
        with self.lock:
            xfer = self.agent.make_prepped_xfer("READ", self._local_descs, local, remote.descs,
                                                remote_indices, notification)
            state = self.agent.transfer(xfer)
        return self._posted(xfer, state)

    def _ranged(self, op: str, remote: _Remote, local_block_ids: Sequence[int],
                remote_block_ids: Sequence[int], notification: bytes, ranges: Sequence[ByteRange],
                layers: Sequence[int] | None) -> TransferHandle:
        """A READ or WRITE of byte ranges of each block: its own descriptor lists, unprepared."""
        assert self.layout is not None
        chosen = range(len(self.layout.layer_names)) if layers is None else layers
        local_bases = [self.layout.base_addresses[i] for i in chosen]
        remote_bases = [remote.layout.base_addresses[i] for i in chosen]
        local_addrs, remote_addrs, lengths = range_copies(
            local_bases, remote_bases, self.layout.block_bytes, remote.layout.block_bytes, local_block_ids,
            remote_block_ids, ranges)
        descs = []
        for addrs, layout in ((local_addrs, self.layout), (remote_addrs, remote.layout)):
            rows = np.empty((len(addrs), 3), dtype=np.uint64)  # [L * n * ranges, 3]
            rows[:, 0], rows[:, 1], rows[:, 2] = addrs, lengths, _device_index(layout.device)
            descs.append((rows, _mem_type(layout.device)))
        with self.lock:
            local_descs = self.agent.get_xfer_descs(*descs[0])
            remote_descs = self.agent.get_xfer_descs(*descs[1])
            xfer = self.agent.initialize_xfer(op, local_descs, remote_descs, remote.agent_name, notification)
            state = self.agent.transfer(xfer)
        return self._posted(xfer, state)

    def write_blocks(self, remote_engine_id: str, local_block_ids: Sequence[int],
                     remote_block_ids: Sequence[int], notification: bytes,
                     layers: Sequence[int] | None = None,
                     ranges: Sequence[ByteRange] | None = None) -> TransferHandle:
        return self._transfer("WRITE", remote_engine_id, local_block_ids, remote_block_ids,
                              notification, layers, ranges)

    def _transfer(self, op: str, remote_engine_id: str, local_block_ids: Sequence[int],
                  remote_block_ids: Sequence[int], notification: bytes,
                  layers: Sequence[int] | None, ranges: Sequence[ByteRange] | None = None) -> TransferHandle:
        remote = self._remotes.get(remote_engine_id)
        if remote is None:
            return FinishedTransfer(f"unknown remote engine {remote_engine_id!r} (never added or removed)")
        if self.layout is None:
            raise RuntimeError("register_kv_caches must come before a transfer")
        check_read(local_block_ids, remote_block_ids, self.layout.num_blocks, remote.layout.num_blocks)
        checked = check_write_ranges(ranges, self.layout.block_bytes, remote.layout.block_bytes)
        num_layers = len(self.layout.layer_names)
        if layers is not None:
            check_layers(layers, num_layers)
        if not local_block_ids or (layers is not None and not layers):
            if notification:
                with self.lock:
                    self.agent.send_notif(remote.agent_name, notification)
            return FinishedTransfer()
        if checked is not None:
            return self._ranged(op, remote, local_block_ids, remote_block_ids, notification, checked, layers)
        local = descriptor_indices(local_block_ids, num_layers, self.layout.num_blocks, layers)
        remote_indices = descriptor_indices(remote_block_ids, num_layers, remote.layout.num_blocks, layers)
        with self.lock:
            xfer = self.agent.make_prepped_xfer(op, self._local_descs, local, remote.descs,
                                                remote_indices, notification)
            state = self.agent.transfer(xfer)
        return self._posted(xfer, state)

    def _posted(self, xfer: Any, state: str) -> _NixlRead:
        handle = _NixlRead(self, xfer, state)
        if state == "PROC":
            with self.lock:
                self._in_flight.add(handle)
            self._kick.set()
        return handle

    def expect_remote_access(self, expecting: bool) -> None:
        if expecting and not self._expecting:
            self._kick.set()
        elif not expecting and self._expecting:
            self._busy_until = time.monotonic() + _LINGER_S  # trailing messages of what just ended
        self._expecting = expecting

    def get_notifications(self) -> list[bytes]:
        if self._progress_thread is None:
            self._collect_notifications()
            self._advance()
        queue = self._notifications
        return [queue.popleft() for _ in range(len(queue))]

    def _collect_notifications(self) -> None:
        with self.lock:
            by_agent = self.agent.get_new_notifs()  # also progresses the UCX worker
        for messages in by_agent.values():
            if messages:
                self._busy_until = time.monotonic() + _LINGER_S
            self._notifications.extend(bytes(m) for m in messages)

    def _advance(self) -> None:
        """Check every transfer in flight: the check is what sends a completed one's notification."""
        with self.lock:
            ended = [handle for handle in self._in_flight if handle._check()]
            self._in_flight.difference_update(ended)
        if ended:
            wakeup.notify()  # NOTE: an engine waiting on one of them polls it now, not at its next tick

    def _progress_loop(self) -> None:
        while True:
            self._kick.wait(self._pace())
            self._kick.clear()
            if self._closed:
                return
            try:
                self._collect_notifications()
                self._advance()
            except Exception:
                logger.exception("NIXL transport: progress failed")

    def _pace(self) -> float:
        """Seconds until the next poll: short while anything can happen, long otherwise."""
        if self._expecting or self._in_flight or time.monotonic() < self._busy_until:
            return self._progress_interval_s
        return self._idle_interval_s

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._kick.set()
        if self._progress_thread is not None:
            self._progress_thread.join()
        for remote_engine_id in list(self._remotes):
            self.remove_remote(remote_engine_id)
        with self.lock:
            if self._local_descs is not None:
                self._local_descs.release()
            if self._reg_descs is not None:
                self.agent.deregister_memory(self._reg_descs)
        del self.agent

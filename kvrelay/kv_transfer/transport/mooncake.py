"""The Mooncake transport: one-sided reads (and, for the push connector, writes) through
Mooncake's Transfer Engine.

Each side runs one `mooncake.engine.TransferEngine` with P2PHANDSHAKE metadata (peers find each
other's registered buffers over the engine's own RPC port; no metadata server) and protocol
`tcp`, or `rdma` where the fabric has devices. Every layer's KV tensor is registered once, so a
read is a list of (local address, remote address, length) triples: block b of layer l sits at
base_address(l) + b * block_bytes on both sides, and adjacent block ids on both sides fold into
one triple. A read by byte ranges (a KV-head slice between TP sizes that differ) is one triple
per (layer, block, range). Batches are cut at `max_batch_entries` (the engine refuses a batch of
4096).

Reads run on one thread here (`batch_transfer_sync_read` releases the GIL), so `read_blocks`
returns at once and the handle is polled. Once a read's bytes sit in D's blocks, D sends the
notification to P over a kvrelay side channel (ZMQ, every message HMAC-signed with the
transport key; see kvrelay/kv_transfer/side_channel.py), not through Mooncake's own
unauthenticated notifications: a forged "done" would let P reuse blocks D is still reading.

NOTE: like NIXL/UCX, the Transfer Engine does not authenticate its data port: whoever reaches
it can read the registered KV. Bind it to loopback or a trusted network (kv_ip).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from kvrelay.kv_transfer.side_channel import SideChannelClient, SideChannelError, SideChannelServer
from kvrelay.kv_transfer.transport.base import (
    ByteRange,
    FinishedTransfer,
    KVTransport,
    RegionLayout,
    TransferHandle,
    TransferState,
    TransportError,
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

PROTOCOLS = ("tcp", "rdma")
_PUBLIC_KEY = b"kvrelay mooncake notifications, no secret configured"


def import_mooncake_engine() -> Any:
    """The mooncake.engine module; ImportError (with the reason) where the wheel cannot load."""
    from mooncake import engine

    return engine


def mooncake_available() -> tuple[bool, str]:
    """Whether the Transfer Engine loads here, and why not (missing wheel or system library)."""
    try:
        import_mooncake_engine()
    except ImportError as e:
        return False, f"mooncake.engine does not load: {e}"
    return True, ""


class AgentInfo(msgspec.Struct, array_like=True):
    """The handshake blob: where a peer reads our blocks and sends notifications."""

    session: str  # "host:rpc_port" of the Transfer Engine
    notify_host: str
    notify_port: int


class _Notify(msgspec.Struct, array_like=True):
    message: bytes


class _NotifyAck(msgspec.Struct, array_like=True):
    pass


def read_triples(local_bases: Sequence[int], remote_bases: Sequence[int], block_bytes: int,
                 local_block_ids: Sequence[int], remote_block_ids: Sequence[int]
                 ) -> tuple[list[int], list[int], list[int]]:
    """(local addresses, remote addresses, lengths) for every layer, folding runs of blocks that
    are adjacent on both sides into one entry."""
    runs: list[tuple[int, int, int]] = []  # (local block, remote block, count)
    for local, remote in zip(local_block_ids, remote_block_ids, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == local and runs[-1][1] + runs[-1][2] == remote:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((local, remote, 1))
    locals_, remotes, lengths = [], [], []
    for local_base, remote_base in zip(local_bases, remote_bases, strict=True):
        for local, remote, count in runs:
            locals_.append(local_base + local * block_bytes)
            remotes.append(remote_base + remote * block_bytes)
            lengths.append(count * block_bytes)
    return locals_, remotes, lengths


class _MooncakeRead(TransferHandle):
    """Settled by the reader thread; `release` cannot stop a read already posted to the engine,
    so a released read still runs to its end (the caller waits for it before reusing blocks)."""

    def __init__(self) -> None:
        self._state = TransferState.PENDING
        self._error: str | None = None

    def settle(self, error: str | None) -> None:
        self._error = error
        self._state = TransferState.DONE if error is None else TransferState.ERROR

    def poll(self) -> TransferState:
        return self._state

    def release(self) -> None:
        pass

    @property
    def error(self) -> str | None:
        return self._error


@dataclass
class _Remote:
    info: AgentInfo
    layout: RegionLayout


@dataclass
class _Job:
    remote_engine_id: str
    triples: tuple[list[int], list[int], list[int]]
    notification: bytes
    handle: _MooncakeRead | None  # None: a notification alone
    write: bool = False  # a push (P writes into the remote's blocks) rather than a read


class MooncakeTransport(KVTransport):
    """A Transfer Engine on `host` (its RPC port is chosen by the engine) plus a notification
    side channel on `host`, signed with `secret` (a public key without one: loopback only)."""

    name = "mooncake"

    def __init__(self, engine_id: str, host: str = "127.0.0.1", *, secret: bytes | None = None,
                 protocol: str = "tcp", device_name: str = "", timeout_s: float = 10.0,
                 max_batch_entries: int = 1024) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"mooncake protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        api = import_mooncake_engine()
        self.engine_id = engine_id
        self.timeout_s = timeout_s
        self.max_batch_entries = max_batch_entries
        self.engine = api.TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransportError(f"Mooncake Transfer Engine did not start on {host} with protocol "
                                 f"{protocol!r} (rc {rc}); for rdma, name a device (mooncake_device)")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._key = secret or _PUBLIC_KEY
        self._notifications: deque[bytes] = deque()
        self._server = SideChannelServer(host, 0, self._key, f"mooncake-{engine_id}",
                                         {"notify": self._on_notify})
        self._info = AgentInfo(self.session, host, self._server.port)
        self.layout: RegionLayout | None = None
        self._registered: list[int] = []
        self._remotes: dict[str, _Remote] = {}
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._closed = False
        self._reader = threading.Thread(target=self._read_loop, name="kvrelay-mooncake-reader", daemon=True)
        self._reader.start()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> RegionLayout:
        layout = describe_kv_caches(kv_caches)
        if layout.device != "cpu":
            raise ValueError(f"the mooncake transport here reads host memory; KV is on {layout.device}")
        for kv in kv_caches.values():
            rc = self.engine.register_memory(kv.data_ptr(), kv.numel() * kv.element_size())
            if rc != 0:
                raise TransportError(f"Mooncake could not register {kv.numel() * kv.element_size()} "
                                     f"bytes of KV (rc {rc})")
            self._registered.append(kv.data_ptr())
        self.layout = layout
        return layout

    def agent_metadata(self) -> bytes:
        return msgspec.msgpack.encode(self._info)

    def add_remote(self, remote_engine_id: str, agent_metadata: bytes, layout: RegionLayout) -> None:
        if remote_engine_id in self._remotes:
            return
        if self.layout is not None:
            check_compatible(self.layout, layout)
        try:
            info = msgspec.msgpack.decode(agent_metadata, type=AgentInfo)
        except msgspec.DecodeError as e:
            raise TransportError(f"remote {remote_engine_id!r} sent no Mooncake agent info ({e}); "
                                 "do both sides use backend 'mooncake'?") from None
        self._remotes[remote_engine_id] = _Remote(info, layout)

    def remove_remote(self, remote_engine_id: str) -> None:
        self._remotes.pop(remote_engine_id, None)

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
            self._jobs.put(_Job(remote_engine_id, ([], [], []), notification, None))
            return FinishedTransfer()
        if checked is None:
            triples = read_triples(self.layout.base_addresses, remote.layout.base_addresses,
                                   self.layout.block_bytes, local_block_ids, remote_block_ids)
        else:
            triples = range_copies(self.layout.base_addresses, remote.layout.base_addresses,
                                   self.layout.block_bytes, remote.layout.block_bytes, local_block_ids,
                                   remote_block_ids, checked)
        handle = _MooncakeRead()
        self._jobs.put(_Job(remote_engine_id, triples, notification, handle))
        return handle

    def write_blocks(self, remote_engine_id: str, local_block_ids: Sequence[int],
                     remote_block_ids: Sequence[int], notification: bytes,
                     layers: Sequence[int] | None = None,
                     ranges: Sequence[ByteRange] | None = None) -> TransferHandle:
        """P's side of a push: one-sided WRITEs of the given layers' blocks (or their byte ranges)
        into the remote's, then
        the notification (when not empty) over the signed side channel. As with NIXL, the receiver
        does not see the write itself: the push connector's registration lease guards its blocks."""
        remote = self._remotes.get(remote_engine_id)
        if remote is None:
            return FinishedTransfer(f"unknown remote engine {remote_engine_id!r} (never added or removed)")
        if self.layout is None:
            raise RuntimeError("register_kv_caches must come before write_blocks")
        check_read(local_block_ids, remote_block_ids, self.layout.num_blocks, remote.layout.num_blocks)
        checked = check_write_ranges(ranges, self.layout.block_bytes, remote.layout.block_bytes)
        chosen = check_layers(layers, len(self.layout.base_addresses))
        local_bases = [self.layout.base_addresses[i] for i in chosen]
        remote_bases = [remote.layout.base_addresses[i] for i in chosen]
        if checked is None:
            triples = read_triples(local_bases, remote_bases, self.layout.block_bytes, local_block_ids,
                                   remote_block_ids)
        else:
            triples = range_copies(local_bases, remote_bases, self.layout.block_bytes,
                                   remote.layout.block_bytes, local_block_ids, remote_block_ids, checked)
        handle = _MooncakeRead()
        self._jobs.put(_Job(remote_engine_id, triples, notification, handle, write=True))
        return handle

    def get_notifications(self) -> list[bytes]:
        queue_ = self._notifications
        return [queue_.popleft() for _ in range(len(queue_))]

    def _on_notify(self, body: bytes) -> tuple[str, msgspec.Struct]:
        self._notifications.append(msgspec.msgpack.decode(body, type=_Notify).message)
        return "notified", _NotifyAck()

    # ---------------------------------------------------------------- reader thread

    def _read_loop(self) -> None:
        ctx = zmq.Context()
        clients: dict[tuple[str, int], SideChannelClient] = {}
        try:
            while (job := self._jobs.get()) is not None:
                self._run(job, ctx, clients)
        finally:
            for client in clients.values():
                client.close()
            ctx.term()

    def _run(self, job: _Job, ctx: zmq.Context, clients: dict[tuple[str, int], SideChannelClient]) -> None:
        remote = self._remotes.get(job.remote_engine_id)
        if remote is None:
            if job.handle is not None:
                job.handle.settle(f"remote engine {job.remote_engine_id!r} was removed before the read")
            return
        if job.handle is not None:
            error = self._transfer(remote.info.session, *job.triples, write=job.write)
            job.handle.settle(error)
            if error is not None:
                return
        if job.write and not job.notification:  # nothing to say (TCP-style pushes, none here today)
            return
        address = (remote.info.notify_host, remote.info.notify_port)
        if address not in clients:
            clients[address] = SideChannelClient(ctx, *address, self._key)
        try:
            clients[address].call("notify", _Notify(job.notification), self.timeout_s)
        except SideChannelError as e:  # the bytes are here; P frees the blocks when its lease ends
            logger.warning("mooncake transport: notification to %s failed: %s", job.remote_engine_id, e)
            clients.pop(address).close()

    def _transfer(self, session: str, local: list[int], remote: list[int], lengths: list[int],
                  write: bool = False) -> str | None:
        step = self.max_batch_entries
        verb, call = (("write to", self.engine.batch_transfer_sync_write) if write
                      else ("read from", self.engine.batch_transfer_sync_read))
        for start in range(0, len(local), step):
            end = start + step
            try:
                rc = call(session, local[start:end], remote[start:end], lengths[start:end])
            except Exception as e:  # the binding raises on a malformed request
                return f"Mooncake {verb} {session} raised {type(e).__name__}: {e}"
            if rc != 0:
                return f"Mooncake {verb} {session} failed (rc {rc}): peer gone or blocks not registered"
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._reader.join(timeout=self.timeout_s + 5)
        self._server.close()
        for address in self._registered:
            self.engine.unregister_memory(address)
        self._registered.clear()
        del self.engine

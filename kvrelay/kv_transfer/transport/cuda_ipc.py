"""The CUDA IPC transport: P and D on one host, KV copied GPU to GPU at device speed, whatever
UCX was built with.

P exports an IPC handle of every layer's KV tensor into its agent blob, which travels in the
authenticated handshake. D opens them once per peer (`add_remote`), then a read is a handful of
device-to-device copies on a side stream: runs of blocks consecutive on both sides fold into one
copy, a heterogeneous-TP read copies only its heads' byte ranges (see block_copy.py). A CUDA
event after the copies settles the read; once it has, D's sender thread posts the notification
to P's inbox over a signed side channel (notify.py), as the Mooncake transport does. Push is the
mirror image: D's agent blob carries D's handles and P copies into them.

The opened tensors of a peer are dropped when the peer is removed (a restarted P is a new peer,
handshaken again), but only once the copies already queued from them have settled, so no copy
reads memory whose mapping is gone.

Everything but the CUDA calls sits behind the IPC seam (ipc.py): the tests run this transport on
host memory shared between processes, so its bookkeeping is exercised on any machine.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

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
)
from kvrelay.kv_transfer.transport.block_copy import CopyPlan, block_bytes_view, copy_layer, plan_copies
from kvrelay.kv_transfer.transport.ipc import CudaIpc, IpcSeam
from kvrelay.kv_transfer.transport.notify import PUBLIC_KEY, NotificationInbox, NotificationSender
from kvrelay.kv_transfer.transport.streams import CopyEvent

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def host_identity() -> str:
    """This host as IPC sees it: the hostname and this boot (two containers of one machine may
    share a hostname; CUDA IPC also needs the same GPUs, which opening a handle proves)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


class IpcAgent(msgspec.Struct, array_like=True):
    """The handshake blob: this side's KV handles and where to post notifications."""

    host: str  # host_identity()
    pid: int
    seam: str  # the IpcSeam's name: both sides must share memory the same way
    dtype: str  # e.g. "float16"
    shape: list[int]  # one layer's KV tensor
    handles: list[list[Any]]  # per layer, as IpcSeam.export gave them
    notify_host: str
    notify_port: int


@dataclass(eq=False)
class _Peer:
    agent: IpcAgent
    layout: RegionLayout
    blocks: list[torch.Tensor]  # per layer, the opened tensor as [num_blocks, block_bytes] bytes
    in_flight: int = 0
    removed: bool = False


class _IpcCopy(TransferHandle):
    """Copies queued on the side stream, settled by their event on the first poll after it."""

    def __init__(self, transport: CudaIpcTransport, peer: _Peer, event: CopyEvent,
                 error: str | None) -> None:
        self._transport, self._peer, self._event = transport, peer, event
        self._error = error
        self._state = TransferState.PENDING
        peer.in_flight += 1

    def poll(self) -> TransferState:
        if self._state != TransferState.PENDING:
            return self._state
        try:
            settled = self._event.query()
        except Exception as e:  # a CUDA error in the copies: they are over, and failed
            settled, self._error = True, f"a CUDA IPC copy failed: {type(e).__name__}: {e}"
        if settled:
            self._state = TransferState.DONE if self._error is None else TransferState.ERROR
            self._transport._settled(self, self._peer)
        return self._state

    def release(self) -> None:
        """Copies on a GPU stream cannot be recalled: a released read still runs to its end (the
        puller keeps polling it before it reuses the blocks), and notifies as any other (the
        sender thread posts a read's notification once its event settled, polled or not)."""

    @property
    def error(self) -> str | None:
        return self._error if self._state == TransferState.ERROR else None


class CudaIpcTransport(KVTransport):
    """Reads (and writes) a same-host peer's KV through IPC handles. `ipc` is the seam; None
    picks CUDA IPC (ValueError without a GPU) when the KV caches are registered."""

    name = "cuda_ipc"

    def __init__(self, engine_id: str, host: str = "127.0.0.1", *, secret: bytes | None = None,
                 timeout_s: float = 10.0, ipc: IpcSeam | None = None) -> None:
        self.engine_id = engine_id
        self.timeout_s = timeout_s
        self.ipc = ipc
        key = secret or PUBLIC_KEY
        self._inbox = NotificationInbox(host, key, f"cuda-ipc-{engine_id}")
        self._sender = NotificationSender(key, timeout_s, "kvrelay-cuda-ipc-notify")
        self.layout: RegionLayout | None = None
        self._kv: list[torch.Tensor] = []  # per layer, [num_blocks, block_bytes] bytes
        self._agent: IpcAgent | None = None
        self._peers: dict[str, _Peer] = {}
        self._draining: list[_Peer] = []  # removed peers whose copies have not all settled
        self._in_flight: set[_IpcCopy] = set()
        self._closed = False

    # ---------------------------------------------------------------- registration

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> RegionLayout:
        first = next(iter(kv_caches.values()), None)
        if first is None:
            raise ValueError("no KV caches to register")
        if self.ipc is None:
            self.ipc = CudaIpc(str(first.device))
        self.ipc.check_device(str(first.device))
        handles = [self.ipc.export(kv) for kv in kv_caches.values()]  # NOTE: before the layout: may move
        layout = describe_kv_caches(kv_caches)
        self._kv = [block_bytes_view(kv) for kv in kv_caches.values()]
        self._agent = IpcAgent(host=host_identity(), pid=os.getpid(), seam=self.ipc.name,
                               dtype=str(first.dtype).removeprefix("torch."), shape=list(first.shape),
                               handles=handles, notify_host=self._inbox.host, notify_port=self._inbox.port)
        self.layout = layout
        return layout

    def agent_metadata(self) -> bytes:
        if self._agent is None:
            raise RuntimeError("register_kv_caches must come before agent_metadata")
        return msgspec.msgpack.encode(self._agent)

    def add_remote(self, remote_engine_id: str, agent_metadata: bytes, layout: RegionLayout) -> None:
        if remote_engine_id in self._peers:
            return
        if self.layout is None or self.ipc is None:
            raise RuntimeError("register_kv_caches must come before add_remote")
        check_compatible(self.layout, layout)
        agent = self._decode_agent(remote_engine_id, agent_metadata)
        blocks = self._open(remote_engine_id, agent, layout)
        self._peers[remote_engine_id] = _Peer(agent, layout, blocks)
        logger.info("cuda_ipc: opened %d KV handles of engine %s (pid %d)", len(blocks), remote_engine_id,
                    agent.pid)

    def _decode_agent(self, remote_engine_id: str, agent_metadata: bytes) -> IpcAgent:
        assert self.ipc is not None
        try:
            agent = msgspec.msgpack.decode(agent_metadata, type=IpcAgent)
        except msgspec.DecodeError as e:
            raise TransportError(f"engine {remote_engine_id!r} sent no CUDA IPC agent ({e}): do both "
                                 "sides use backend 'cuda_ipc'?") from None
        here = host_identity()
        if agent.host != here:
            raise TransportError(f"engine {remote_engine_id!r} runs on {agent.host}, this one on {here}: "
                                 "cuda_ipc needs both on one host; use backend 'nixl' (or 'tcp' with "
                                 "kv_buffer_device 'cpu') between hosts")
        if agent.seam != self.ipc.name:
            raise TransportError(f"engine {remote_engine_id!r} shares its KV by {agent.seam!r} IPC, this "
                                 f"one by {self.ipc.name!r}")
        return agent

    def _open(self, remote_engine_id: str, agent: IpcAgent, layout: RegionLayout) -> list[torch.Tensor]:
        import torch

        assert self.ipc is not None
        dtype = getattr(torch, agent.dtype, None)
        if not isinstance(dtype, torch.dtype) or len(agent.handles) != len(layout.layer_names):
            raise TransportError(f"engine {remote_engine_id!r} sent a malformed CUDA IPC agent "
                                 f"(dtype {agent.dtype!r}, {len(agent.handles)} handles)")
        opened: list[torch.Tensor] = []
        try:
            for handle in agent.handles:
                opened.append(block_bytes_view(self.ipc.open(handle, dtype, tuple(agent.shape))))
        except Exception as e:
            for tensor in opened:
                self.ipc.close(tensor)
            raise TransportError(f"cannot open the KV handles of engine {remote_engine_id!r} (pid "
                                 f"{agent.pid}): {type(e).__name__}: {e}; is it on another GPU set or "
                                 "container? use backend 'nixl' or kv_buffer_device 'cpu'") from None
        if opened and tuple(opened[0].shape) != (layout.num_blocks, layout.block_bytes):
            for tensor in opened:
                self.ipc.close(tensor)
            raise TransportError(f"engine {remote_engine_id!r}'s KV handles hold {tuple(opened[0].shape)} "
                                 f"blocks x bytes, its handshake says ({layout.num_blocks}, "
                                 f"{layout.block_bytes})")
        return opened

    def remove_remote(self, remote_engine_id: str) -> None:
        peer = self._peers.pop(remote_engine_id, None)
        if peer is None:
            return
        peer.removed = True
        if peer.in_flight:
            self._draining.append(peer)
        else:
            self._close_peer(peer)

    def _close_peer(self, peer: _Peer) -> None:
        assert self.ipc is not None
        for tensor in peer.blocks:
            self.ipc.close(tensor)
        peer.blocks = []

    # ---------------------------------------------------------------- copies

    def read_blocks(self, remote_engine_id: str, local_block_ids: Sequence[int],
                    remote_block_ids: Sequence[int], notification: bytes,
                    ranges: Sequence[ByteRange] | None = None) -> TransferHandle:
        peer = self._peers.get(remote_engine_id)
        if peer is None:
            return FinishedTransfer(f"unknown remote engine {remote_engine_id!r} (never added or removed)")
        assert self.layout is not None
        check_read(local_block_ids, remote_block_ids, self.layout.num_blocks, peer.layout.num_blocks)
        checked = check_ranges(ranges, self.layout.block_bytes, peer.layout.block_bytes)
        if not local_block_ids:
            self._sender.send(peer.agent.notify_host, peer.agent.notify_port, notification)
            return FinishedTransfer()
        plan = plan_copies(local_block_ids, remote_block_ids, checked, self.layout.block_bytes,
                           peer.layout.block_bytes)
        return self._copy(peer, self._kv, peer.blocks, plan, notification)

    def write_blocks(self, remote_engine_id: str, local_block_ids: Sequence[int],
                     remote_block_ids: Sequence[int], notification: bytes,
                     layers: Sequence[int] | None = None,
                     ranges: Sequence[ByteRange] | None = None) -> TransferHandle:
        """P's side of a push: copies into the blocks of D's tensors opened from D's handles. As
        with NIXL, D does not see the write: the push registration's lease guards its blocks."""
        peer = self._peers.get(remote_engine_id)
        if peer is None:
            return FinishedTransfer(f"unknown remote engine {remote_engine_id!r} (never added or removed)")
        assert self.layout is not None
        check_read(local_block_ids, remote_block_ids, self.layout.num_blocks, peer.layout.num_blocks)
        checked = check_write_ranges(ranges, self.layout.block_bytes, peer.layout.block_bytes)
        chosen = check_layers(layers, len(self._kv))
        flipped = None if checked is None else [ByteRange(r.local_offset, r.remote_offset, r.length)
                                                for r in checked]
        # NOTE: planned from the receiver's side: its blocks are the copies' destination.
        plan = plan_copies(remote_block_ids, local_block_ids, flipped, peer.layout.block_bytes,
                           self.layout.block_bytes)
        return self._copy(peer, [peer.blocks[i] for i in chosen], [self._kv[i] for i in chosen], plan,
                          notification)

    def _copy(self, peer: _Peer, dst: list[torch.Tensor], src: list[torch.Tensor], plan: CopyPlan,
              notification: bytes) -> TransferHandle:
        assert self.ipc is not None
        error = None
        with self.ipc.side_stream():
            try:
                for dst_layer, src_layer in zip(dst, src, strict=True):
                    copy_layer(dst_layer, src_layer, plan)
            except Exception as e:  # what was queued still runs: settle after the event
                error = f"a CUDA IPC copy failed: {type(e).__name__}: {e}"
            event = self.ipc.record()
        handle = _IpcCopy(self, peer, event, error)
        self._in_flight.add(handle)
        if error is None and notification:
            self._sender.send(peer.agent.notify_host, peer.agent.notify_port, notification, after=event)
        return handle

    def _settled(self, handle: _IpcCopy, peer: _Peer) -> None:
        self._in_flight.discard(handle)
        peer.in_flight -= 1
        if peer.removed and not peer.in_flight and peer in self._draining:
            self._draining.remove(peer)
            self._close_peer(peer)

    def get_notifications(self) -> list[bytes]:
        return self._inbox.take()

    @property
    def open_peers(self) -> int:
        """Peers whose handles are still open (removed ones included until their copies settle)."""
        return len(self._peers) + len(self._draining)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + self.timeout_s
        while self._in_flight and time.monotonic() < deadline:
            for handle in list(self._in_flight):
                handle.poll()
            time.sleep(0.001)
        if self._in_flight:
            # NOTE: dropping a peer's opened tensors unmaps its memory, and torch's IPC deleter
            # waits for the current stream only, not for our side stream: wait for the copies.
            logger.error("cuda_ipc: %d copies still queued at close: waiting for them before the peers' "
                         "memory is unmapped", len(self._in_flight))
            assert self.ipc is not None
            self.ipc.synchronize()
            for handle in list(self._in_flight):
                handle.poll()
        for engine_id in list(self._peers):
            self.remove_remote(engine_id)
        for peer in self._draining:
            self._close_peer(peer)
        self._draining.clear()
        self._sender.close()
        self._inbox.close()

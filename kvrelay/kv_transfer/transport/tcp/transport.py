"""The built-in TCP transport: pull and push over plain sockets, for machines without NIXL.

P's data port (server.py) answers reads; D's reads run on a small thread pool so `read_blocks`
returns at once. One read on one persistent connection:

    D -> P   READ header (block count, notification length), remote block ids, notification
    P -> D   status (OK, or an error message), then for each layer in order the requested
             blocks, adjacent block ids sent as one slice straight from P's KV tensor
    D -> P   ACK once every byte sits in D's blocks; P queues the notification on the ACK,
             so a notification always means "D has the bytes"

A read by byte ranges (RRNG: a KV-head slice of each block, between instances of different TP
sizes) also sends the ranges (remote offset, length) after the block ids; P then streams, layer
by layer and block by block, only those ranges of each block, and D lands each at its own offset.

Bytes move from memoryviews over P's tensor into memoryviews over D's destination blocks with
vectored calls: P hands the kernel every (layer, run of blocks) slice in one sendmsg, D one
recvmsg_into with MSG_WAITALL over the matching slices of its blocks (up to IOV_MAX slices a
call). No pickling, no copy beyond the kernel's, and a whole read costs a handful of system
calls, so the threads take the GIL a few times per read rather than once per socket buffer: a
busy engine thread then barely slows a transfer. Every socket has a timeout, so a dead or
stalled peer ends a read in ERROR, never a hang.

A push runs the other way: P opens the connection to D's data port and WRITes (server.py
takes it there, through D's write guard); a write is not retried, since its bytes may already
sit in D's blocks.

With a shared secret, every connection starts with a mutual HMAC challenge-response; without
one, the data port serves anyone who can reach it (bind it to loopback).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvrelay.kv_transfer import wakeup
from kvrelay.kv_transfer.transport.base import (
    ByteRange,
    FinishedTransfer,
    KVTransport,
    RegionLayout,
    TransferHandle,
    TransferState,
    TransportError,
    WriteGuard,
    check_compatible,
    check_layers,
    check_ranges,
    check_read,
    check_write_ranges,
    describe_kv_caches,
)
from kvrelay.kv_transfer.transport.tcp import wire
from kvrelay.kv_transfer.transport.tcp.server import BlockServer

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def _wake_engine(_future: Future[None]) -> None:
    wakeup.notify()


class _TcpRead(TransferHandle):
    def __init__(self, future: Future[None]) -> None:
        self._future = future

    def poll(self) -> TransferState:
        if not self._future.done():
            return TransferState.PENDING
        return TransferState.ERROR if self._future.exception() is not None else TransferState.DONE

    def release(self) -> None:
        pass  # NOTE: a pending read still ends by itself within the socket timeout

    @property
    def error(self) -> str | None:
        if not self._future.done() or self._future.exception() is None:
            return None
        return str(self._future.exception())


class _Remote:
    """A peer's address, layout and idle connections (one connection serves one read at a time)."""

    def __init__(self, engine_id: str, address: tuple[str, int], layout: RegionLayout) -> None:
        self.engine_id = engine_id
        self.address = address
        self.layout = layout
        self.idle: list[socket.socket] = []
        self.removed = False


class TcpTransport(KVTransport):
    """Pull transport over TCP. `host`/`port` is where P's data port listens (port 0: any free
    port); `secret`, when set, must be the same on both ends; `timeout_s` bounds every socket
    wait, so a dead peer fails a read after at most that long."""

    name = "tcp"
    sees_writes = True

    def __init__(self, engine_id: str, host: str = "127.0.0.1", port: int = 0, *,
                 secret: bytes | None = None, num_workers: int = 2, timeout_s: float = 10.0) -> None:
        self.engine_id = engine_id
        self.secret = secret
        self.timeout_s = timeout_s
        self._server = BlockServer(host, port, secret, timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="kvrelay-tcp-read")
        self._num_workers = num_workers
        self._in_flight = 0  # reads submitted and not yet ended (under _lock)
        self._lock = threading.Lock()
        self._remotes: dict[str, _Remote] = {}
        self._active: set[socket.socket] = set()
        self._layers: list[memoryview] = []
        self.layout: RegionLayout | None = None
        self._closed = False

    @property
    def address(self) -> tuple[str, int]:
        """Where this side's data port listens."""
        host, port = self._server.address
        return str(host), int(port)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> RegionLayout:
        layout = describe_kv_caches(kv_caches)
        if layout.device != "cpu":
            raise ValueError(f"the TCP transport reads CPU tensors only, got KV caches on {layout.device}; "
                             "use the nixl backend for device memory")
        self._layers = [wire.byte_view(kv) for kv in kv_caches.values()]
        self._server.serve(self._layers, layout.num_blocks, layout.block_bytes)
        self.layout = layout
        return layout

    def agent_metadata(self) -> bytes:
        host, port = self.address
        return f"{host}:{port}".encode()

    def add_remote(self, remote_engine_id: str, agent_metadata: bytes, layout: RegionLayout) -> None:
        if remote_engine_id in self._remotes:
            return
        if self.layout is not None:
            check_compatible(self.layout, layout)
        host, _, port = agent_metadata.decode().rpartition(":")
        with self._lock:
            self._remotes[remote_engine_id] = _Remote(remote_engine_id, (host, int(port)), layout)

    def remove_remote(self, remote_engine_id: str) -> None:
        with self._lock:
            remote = self._remotes.pop(remote_engine_id, None)
            if remote is None:
                return
            remote.removed = True
            idle, remote.idle = remote.idle, []
        for sock in idle:
            sock.close()

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
        ids = struct.pack(f"!{len(remote_block_ids)}I", *remote_block_ids)
        if checked is None:
            request = (wire.READ.pack(wire.MAGIC_READ, len(remote_block_ids), len(notification))
                       + ids + notification)
        else:
            flat = [value for r in checked for value in (r.remote_offset, r.length)]
            request = (wire.READ.pack(wire.MAGIC_READ_RANGES, len(remote_block_ids), len(notification))
                       + wire.NUM_RANGES.pack(len(checked)) + ids + struct.pack(f"!{len(flat)}I", *flat)
                       + notification)
        with self._lock:
            self._in_flight += 1
        sent_on = self._send_on_idle(remote, request)
        try:
            future = self._pool.submit(self._read, remote, list(local_block_ids), list(remote_block_ids),
                                       request, sent_on, checked)
            future.add_done_callback(_wake_engine)  # after the future is done, so a poll sees it
        except BaseException:
            with self._lock:
                self._in_flight -= 1
            if sent_on is not None:
                self._discard(sent_on)
            raise
        return _TcpRead(future)

    def write_blocks(self, remote_engine_id: str, local_block_ids: Sequence[int],
                     remote_block_ids: Sequence[int], notification: bytes,
                     layers: Sequence[int] | None = None,
                     ranges: Sequence[ByteRange] | None = None) -> TransferHandle:
        """Check the request, then write on a pool thread."""
        remote = self._remotes.get(remote_engine_id)
        if remote is None:
            return FinishedTransfer(f"unknown remote engine {remote_engine_id!r} (never added or removed)")
        if self.layout is None:
            raise RuntimeError("register_kv_caches must come before write_blocks")
        check_read(local_block_ids, remote_block_ids, self.layout.num_blocks, remote.layout.num_blocks)
        checked = check_write_ranges(ranges, self.layout.block_bytes, remote.layout.block_bytes)
        chosen = check_layers(layers, len(self._layers))
        future = self._pool.submit(self._write, remote, list(local_block_ids), list(remote_block_ids),
                                   notification, chosen, checked)
        return _TcpRead(future)

    def set_write_guard(self, guard: WriteGuard | None) -> None:
        self._server.write_guard = guard

    def get_notifications(self) -> list[bytes]:
        queue = self._server.notifications
        return [queue.popleft() for _ in range(len(queue))]

    # --- D's side, on a pool thread -------------------------------------------------------

    def _send_on_idle(self, remote: _Remote, request: bytes) -> socket.socket | None:
        """Send a READ from the caller's thread on an idle connection, when a pool thread is free
        to take the answer at once: P starts streaming while the pool thread wakes up, instead of
        after (one thread hand-off less on the read's path; on a busy machine each costs up to a
        scheduler slice). None when no connection is idle or every pool thread is busy (a read
        queued behind others must not start P's send before anyone receives: P would stall in
        its send timeout), or when the send failed: the pool thread then does it all."""
        with self._lock:
            if remote.removed or self._closed or not remote.idle or self._in_flight > self._num_workers:
                return None
            sock = remote.idle.pop()
            self._active.add(sock)
        try:
            sock.sendall(request)  # a few KB into an idle connection's empty send buffer
        except OSError:
            self._discard(sock)
            return None
        return sock

    def _read(self, remote: _Remote, local_block_ids: list[int], remote_block_ids: list[int],
              request: bytes, sent_on: socket.socket | None, ranges: list[ByteRange] | None) -> None:
        try:
            self._read_blocks(remote, local_block_ids, remote_block_ids, request, sent_on, ranges)
        finally:
            with self._lock:
                self._in_flight -= 1

    def _read_blocks(self, remote: _Remote, local_block_ids: list[int], remote_block_ids: list[int],
                     request: bytes, sent_on: socket.socket | None, ranges: list[ByteRange] | None) -> None:
        sock, reused = (sent_on, True) if sent_on is not None else self._checkout(remote)
        try:
            try:
                if sent_on is None:
                    sock.sendall(request)
                status, message_len = wire.STATUS.unpack(wire.recv_bytes(sock, wire.STATUS.size))
            except (OSError, ConnectionError):
                if not reused:
                    raise
                # NOTE: an idle connection may have died meanwhile (P restarted, a timeout):
                # nothing was read yet, so ask once more on a fresh one.
                self._discard(sock)
                sock, _ = self._checkout(remote, reuse=False)
                sock.sendall(request)
                status, message_len = wire.STATUS.unpack(wire.recv_bytes(sock, wire.STATUS.size))
            if status != 0:
                if message_len > wire.MAX_ERROR_BYTES:
                    raise ConnectionError(f"peer announced a {message_len}-byte error message")
                message = wire.recv_bytes(sock, message_len).decode(errors="replace")
                self._checkin(remote, sock)
                raise TransportError(f"engine {remote.engine_id} refused the read: {message}")
            self._recv_blocks(sock, local_block_ids, remote_block_ids, ranges)
            sock.sendall(wire.ACK)
        except (OSError, ConnectionError) as e:
            self._discard(sock)
            raise TransportError(f"read from engine {remote.engine_id} at {remote.address[0]}:"
                                 f"{remote.address[1]} failed: {e}") from e
        self._checkin(remote, sock)

    def _recv_blocks(self, sock: socket.socket, local_block_ids: list[int], remote_block_ids: list[int],
                     ranges: list[ByteRange] | None) -> None:
        assert self.layout is not None
        if ranges is not None:
            local_ranges = [(r.local_offset, r.length) for r in ranges]
            wire.recv_views(sock, wire.range_slices(self._layers, local_block_ids, self.layout.block_bytes,
                                                    local_ranges))
            return
        runs = wire.paired_runs(local_block_ids, remote_block_ids)
        wire.recv_views(sock, wire.block_slices(self._layers, runs, self.layout.block_bytes))

    def _checkout(self, remote: _Remote, reuse: bool = True) -> tuple[socket.socket, bool]:
        """An idle connection to the remote, or a new authenticated one; and whether it was idle."""
        with self._lock:
            if remote.removed or self._closed:
                raise TransportError(f"engine {remote.engine_id} was removed")
            sock = remote.idle.pop() if remote.idle and reuse else None
            if sock is not None:
                self._active.add(sock)
                return sock, True
        try:
            sock = socket.create_connection(remote.address, timeout=self.timeout_s)
        except OSError as e:
            raise TransportError(f"cannot connect to engine {remote.engine_id} at "
                                 f"{remote.address[0]}:{remote.address[1]}: {e}") from e
        wire.configure(sock, self.timeout_s)
        with self._lock:
            self._active.add(sock)
        try:
            self._authenticate(sock)
        except BaseException:
            self._discard(sock)
            raise
        return sock, False

    def _authenticate(self, sock: socket.socket) -> None:
        magic, auth_required, server_nonce = wire.HELLO.unpack(wire.recv_bytes(sock, wire.HELLO.size))
        if magic != wire.MAGIC_HELLO:
            raise TransportError(f"peer is not a kvrelay TCP transport (hello {magic!r})")
        if not auth_required and self.secret is None:
            return
        if not auth_required:
            raise TransportError("peer does not authenticate but this side has a shared secret: refusing it")
        if self.secret is None:
            raise TransportError("peer requires a shared secret and this side has none")
        client_nonce = secrets.token_bytes(16)
        sock.sendall(wire.AUTH.pack(client_nonce, wire.proof(self.secret, b"D", server_nonce, client_nonce)))
        verdict = sock.recv(1)
        if verdict != b"\x00":
            raise TransportError("peer refused the shared secret (the secrets differ)")
        server_proof = wire.recv_bytes(sock, 32)
        if not hmac.compare_digest(server_proof, wire.proof(self.secret, b"P", client_nonce, server_nonce)):
            raise TransportError("peer failed to prove the shared secret")

    def _checkin(self, remote: _Remote, sock: socket.socket) -> None:
        with self._lock:
            self._active.discard(sock)
            if not remote.removed and not self._closed:
                remote.idle.append(sock)
                return
        sock.close()

    def _discard(self, sock: socket.socket) -> None:
        with self._lock:
            self._active.discard(sock)
        sock.close()

    # --- P's side of a push, on a pool thread ----------------------------------------------

    def _write(self, remote: _Remote, local_block_ids: list[int], remote_block_ids: list[int],
               notification: bytes, layers: list[int], ranges: list[ByteRange] | None = None) -> None:
        """P's side, on a pool thread: one WRIT (WRNG with ranges), and D's answer. Raises
        TransportError."""
        assert self.layout is not None
        ids = (struct.pack(f"!{len(remote_block_ids)}I", *remote_block_ids)
               + struct.pack(f"!{len(layers)}I", *layers))
        chosen = [self._layers[layer] for layer in layers]
        block_bytes = self.layout.block_bytes
        if ranges is None:
            header = (wire.READ.pack(wire.MAGIC_WRITE, len(remote_block_ids), len(notification))
                      + wire.LAYERS.pack(len(layers)) + ids + notification)
            slices = wire.block_slices(chosen, wire.runs(local_block_ids), block_bytes)
        else:
            flat = [value for r in ranges for value in (r.remote_offset, r.length)]
            header = (wire.READ.pack(wire.MAGIC_WRITE_RANGES, len(remote_block_ids), len(notification))
                      + wire.LAYERS.pack(len(layers)) + wire.NUM_RANGES.pack(len(ranges)) + ids
                      + struct.pack(f"!{len(flat)}I", *flat) + notification)
            local_ranges = [(r.local_offset, r.length) for r in ranges]
            slices = wire.range_slices(chosen, local_block_ids, block_bytes, local_ranges)
        views = [memoryview(header), *slices]
        # NOTE: unlike a read, a write is not retried on a fresh connection: its bytes may already
        # be in D's blocks, and only D's answer says what happened.
        sock, _ = self._checkout(remote)
        try:
            wire.send_views(sock, views)
            status, message_len = wire.STATUS.unpack(wire.recv_bytes(sock, wire.STATUS.size))
            if status != 0:
                if message_len > wire.MAX_ERROR_BYTES:
                    raise ConnectionError(f"peer announced a {message_len}-byte error message")
                message = wire.recv_bytes(sock, message_len).decode(errors="replace")
                self._checkin(remote, sock)
                raise TransportError(f"engine {remote.engine_id} refused the write: {message}")
        except (OSError, ConnectionError) as e:
            self._discard(sock)
            raise TransportError(f"write to engine {remote.engine_id} at {remote.address[0]}:"
                                 f"{remote.address[1]} failed: {e}") from e
        self._checkin(remote, sock)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            to_close = [s for r in self._remotes.values() for s in r.idle]
            self._remotes.clear()
            for sock in self._active:  # fail in-flight reads now rather than at their timeout
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for sock in to_close:
            sock.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._server.close()

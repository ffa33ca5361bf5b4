"""The built-in TCP transport: a pull over plain sockets, for machines without NIXL.

P's listener thread answers reads; D's reads run on a small thread pool so `read_blocks`
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

A push (tcp_push.py) runs the other way: P opens the connection to D's data port and WRITes.

With a shared secret, every connection starts with a mutual HMAC challenge-response; without
one, the data port serves anyone who can reach it (bind it to loopback).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import select
import socket
import struct
import threading
from collections import deque
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
    check_ranges,
    check_read,
    describe_kv_caches,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_HELLO = struct.Struct("!4sB16s")  # magic, auth required, server nonce
_AUTH = struct.Struct("!16s32s")  # client nonce, client proof
_READ = struct.Struct("!4sII")  # magic, number of blocks, notification length
_STATUS = struct.Struct("!BI")  # 0 = OK / 1 = error, error message length
_MAGIC_HELLO = b"KVR1"
_MAGIC_READ = b"READ"
_MAGIC_READ_RANGES = b"RRNG"  # a READ of byte ranges of each block
_NUM_RANGES = struct.Struct("!I")
_MAX_RANGES = 1024  # a head slice is two ranges (K and V); this bounds P's buffer
_MAGIC_WRITE = b"WRIT"  # a push: see tcp_push.py
_MAGIC_WRITE_RANGES = b"WRNG"  # a push of byte ranges of each block
_ACK = b"A"
_ACCEPT_POLL_S = 0.2
_MAX_NOTIFICATION_BYTES = 64 * 1024  # a notification is "{request_id}:{n}"; this bounds P's buffer
_MAX_ERROR_BYTES = 64 * 1024  # and this D's, for P's reason of a refusal
# NOTE: Linux refuses more than IOV_MAX (1024) buffers in one sendmsg / recvmsg.
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 16


def _proof(secret: bytes, role: bytes, first_nonce: bytes, second_nonce: bytes) -> bytes:
    return hmac.new(secret, role + first_nonce + second_nonce, hashlib.sha256).digest()


def _consume(views: list[memoryview], first: int, num_bytes: int) -> int:
    """Account for `num_bytes` moved from the front of views[first:]: returns the index of the
    first view with bytes left, trimmed in place to what is left of it."""
    while num_bytes:
        size = len(views[first])
        if num_bytes < size:
            views[first] = views[first][num_bytes:]
            return first
        num_bytes -= size
        first += 1
    return first


def _send_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Send the views' bytes in order, IOV_MAX views a sendmsg. A blocking socket sends all it
    was given unless a timeout or a signal cuts the call short: then the rest goes next call."""
    pending = [v for v in views if len(v)]
    first = 0
    while first < len(pending):
        first = _consume(pending, first, sock.sendmsg(pending[first:first + _IOV_MAX]))


def _recv_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill the views in order, IOV_MAX views a recvmsg_into. MSG_WAITALL makes the kernel wait
    until all of them are full, so a call returns early only on a timeout, a signal or a peer
    that closed; a peer that closes early is a ConnectionError."""
    pending = [v for v in views if len(v)]
    size, received, first = sum(len(v) for v in pending), 0, 0
    while first < len(pending):
        n = sock.recvmsg_into(pending[first:first + _IOV_MAX], 0, socket.MSG_WAITALL)[0]
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {received} of {size} bytes")
        received += n
        first = _consume(pending, first, n)


def _recv_bytes(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    _recv_views(sock, [memoryview(buf)])
    return bytes(buf)


def _byte_view(kv: torch.Tensor) -> memoryview:
    """A writable byte view over a CPU tensor's storage (any dtype)."""
    import torch

    return memoryview(kv.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive ids, in order, as (first id, length)."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def _paired_runs(local_block_ids: Sequence[int], remote_block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Runs (first local id, length) where local and remote ids both advance by one: each such
    run is one contiguous slice of the stream P sends for a layer."""
    runs: list[tuple[int, int]] = []
    prev_remote = None
    for local, remote in zip(local_block_ids, remote_block_ids, strict=True):
        extends = prev_remote is not None and remote == prev_remote + 1
        if runs and extends and runs[-1][0] + runs[-1][1] == local:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((local, 1))
        prev_remote = remote
    return runs


def _block_slices(layers: Sequence[memoryview], runs: Sequence[tuple[int, int]],
                  block_bytes: int) -> list[memoryview]:
    """The byte slices of every run of blocks, layer by layer: the order of the stream."""
    return [layer[first * block_bytes:(first + length) * block_bytes]
            for layer in layers for first, length in runs]


def _range_slices(layers: Sequence[memoryview], block_ids: Sequence[int], block_bytes: int,
                  ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
    """The (offset, length) ranges of every block, block by block, layer by layer: the order of
    a read by byte ranges."""
    return [layer[b * block_bytes + offset:b * block_bytes + offset + length]
            for layer in layers for b in block_ids for offset, length in ranges]


def _configure(sock: socket.socket, timeout_s: float) -> None:
    """Blocking socket with kernel-side timeouts (SO_RCVTIMEO / SO_SNDTIMEO): a Python-level
    timeout would add a poll() syscall before every recv, a visible cost at loopback speeds.
    A timeout surfaces as an OSError (EAGAIN) like any other failure."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    timeval = struct.pack("ll", int(timeout_s), int((timeout_s % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


class _BlockServer:
    """P's side: accepts connections and streams requested blocks; queues notifications on ACK."""

    def __init__(self, host: str, port: int, secret: bytes | None, timeout_s: float) -> None:
        self.secret = secret
        self.timeout_s = timeout_s
        self.layers: list[memoryview] = []
        self.num_blocks = 0
        self.block_bytes = 0
        self.notifications: deque[bytes] = deque()
        self.write_guard: WriteGuard | None = None  # None: incoming writes are refused
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server((host, port))
        self.address = self._listener.getsockname()[:2]
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kvrelay-tcp-accept",
                                               daemon=True)
        self._accept_thread.start()

    def serve(self, layers: list[memoryview], num_blocks: int, block_bytes: int) -> None:
        self.layers, self.num_blocks, self.block_bytes = layers, num_blocks, block_bytes

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            readable, _, _ = select.select([self._listener], [], [], _ACCEPT_POLL_S)
            if not readable or self._stopping.is_set():
                continue
            try:
                sock, _ = self._listener.accept()
            except OSError:
                continue
            _configure(sock, self.timeout_s)
            thread = threading.Thread(target=self._serve_connection, args=(sock,),
                                      name="kvrelay-tcp-serve", daemon=True)
            with self._lock:
                self._connections.add(sock)
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def _serve_connection(self, sock: socket.socket) -> None:
        try:
            if self._authenticate(sock):
                while not self._stopping.is_set() and self._serve_one_read(sock):
                    pass
        except (OSError, ConnectionError) as e:
            if not self._stopping.is_set():
                logger.debug("TCP transport: a reader's connection ended: %s", e)
        finally:
            with self._lock:
                self._connections.discard(sock)
            sock.close()

    def _authenticate(self, sock: socket.socket) -> bool:
        server_nonce = secrets.token_bytes(16)
        sock.sendall(_HELLO.pack(_MAGIC_HELLO, self.secret is not None, server_nonce))
        if self.secret is None:
            return True
        client_nonce, proof = _AUTH.unpack(_recv_bytes(sock, _AUTH.size))
        if not hmac.compare_digest(proof, _proof(self.secret, b"D", server_nonce, client_nonce)):
            logger.warning("TCP transport: refused a connection from %s: wrong shared secret",
                           sock.getpeername())
            sock.sendall(b"\x01")
            return False
        sock.sendall(b"\x00" + _proof(self.secret, b"P", client_nonce, server_nonce))
        return True

    def _serve_one_read(self, sock: socket.socket) -> bool:
        """Answer one READ; False when the reader hung up between reads or must be dropped."""
        # NOTE: an idle persistent connection waits for its next request without a timeout;
        # close() shuts it down.
        select.select([sock], [], [])
        header = sock.recv(_READ.size, socket.MSG_WAITALL)
        if not header:
            return False
        if len(header) < _READ.size:
            header += _recv_bytes(sock, _READ.size - len(header))
        magic, num_ids, notification_len = _READ.unpack(header)
        if magic in (_MAGIC_WRITE, _MAGIC_WRITE_RANGES):
            from kvrelay.kv_transfer.transport.tcp_push import serve_one_write

            return serve_one_write(self, sock, num_ids, notification_len, ranged=magic == _MAGIC_WRITE_RANGES)
        if magic not in (_MAGIC_READ, _MAGIC_READ_RANGES):
            raise ConnectionError(f"bad request magic {magic!r}")
        num_ranges = 0
        if magic == _MAGIC_READ_RANGES:
            (num_ranges,) = _NUM_RANGES.unpack(_recv_bytes(sock, _NUM_RANGES.size))
        problem = self._oversize(num_ids, notification_len, num_ranges)
        if problem is not None:  # NOTE: the request's body is not read, so the stream is lost
            self._refuse(sock, problem)
            return False
        body = _recv_bytes(sock, 4 * num_ids + 8 * num_ranges + notification_len)
        block_ids = struct.unpack_from(f"!{num_ids}I", body)
        flat = struct.unpack_from(f"!{2 * num_ranges}I", body, 4 * num_ids)
        ranges = list(zip(flat[::2], flat[1::2], strict=True))  # (offset, length)
        notification = body[4 * num_ids + 8 * num_ranges:]
        problem = self._outside(block_ids, ranges)
        if problem is not None:
            self._refuse(sock, problem)
            return True
        if magic == _MAGIC_READ:
            slices = _block_slices(self.layers, _runs(block_ids), self.block_bytes)
        else:
            slices = _range_slices(self.layers, block_ids, self.block_bytes, ranges)
        _send_views(sock, [memoryview(_STATUS.pack(0, 0)), *slices])
        if _recv_bytes(sock, 1) != _ACK:
            raise ConnectionError("reader did not acknowledge the blocks")
        self.notifications.append(notification)
        return True

    def _outside(self, block_ids: Sequence[int], ranges: Sequence[tuple[int, int]]) -> str | None:
        bad = [b for b in block_ids if b >= self.num_blocks]
        if bad:
            return f"block ids {bad[:8]} are outside the pool of {self.num_blocks} blocks"
        bad_ranges = [r for r in ranges if r[1] == 0 or r[0] + r[1] > self.block_bytes]
        if bad_ranges:
            return f"byte ranges {bad_ranges[:4]} are empty or run past a block of {self.block_bytes} bytes"
        return None

    def _oversize(self, num_ids: int, notification_len: int, num_ranges: int = 0) -> str | None:
        """Why a READ header cannot be honoured before its body is even read, or None."""
        if not self.layers:
            return "this engine has registered no KV caches yet"
        if num_ids > self.num_blocks:
            return (f"a read of {num_ids} blocks is more than the whole pool of {self.num_blocks} "
                    "blocks")
        if num_ranges > _MAX_RANGES:
            return f"a read of {num_ranges} byte ranges per block is over the limit of {_MAX_RANGES}"
        if notification_len > _MAX_NOTIFICATION_BYTES:
            return (f"a notification of {notification_len} bytes is over the limit of "
                    f"{_MAX_NOTIFICATION_BYTES}")
        return None

    @staticmethod
    def _refuse(sock: socket.socket, problem: str) -> None:
        message = problem.encode()
        sock.sendall(_STATUS.pack(1, len(message)) + message)

    def close(self) -> None:
        self._stopping.set()
        self._accept_thread.join()
        self._listener.close()
        with self._lock:
            for sock in self._connections:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            threads = list(self._threads)
        for thread in threads:
            thread.join()


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
        self._server = _BlockServer(host, port, secret, timeout_s)
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
        self._layers = [_byte_view(kv) for kv in kv_caches.values()]
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
            request = _READ.pack(_MAGIC_READ, len(remote_block_ids), len(notification)) + ids + notification
        else:
            flat = [value for r in checked for value in (r.remote_offset, r.length)]
            request = (_READ.pack(_MAGIC_READ_RANGES, len(remote_block_ids), len(notification))
                       + _NUM_RANGES.pack(len(checked)) + ids + struct.pack(f"!{len(flat)}I", *flat)
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
        from kvrelay.kv_transfer.transport.tcp_push import start_write

        return start_write(self, remote_engine_id, local_block_ids, remote_block_ids, notification, layers,
                           ranges)

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
                status, message_len = _STATUS.unpack(_recv_bytes(sock, _STATUS.size))
            except (OSError, ConnectionError):
                if not reused:
                    raise
                # NOTE: an idle connection may have died meanwhile (P restarted, a timeout):
                # nothing was read yet, so ask once more on a fresh one.
                self._discard(sock)
                sock, _ = self._checkout(remote, reuse=False)
                sock.sendall(request)
                status, message_len = _STATUS.unpack(_recv_bytes(sock, _STATUS.size))
            if status != 0:
                if message_len > _MAX_ERROR_BYTES:
                    raise ConnectionError(f"peer announced a {message_len}-byte error message")
                message = _recv_bytes(sock, message_len).decode(errors="replace")
                self._checkin(remote, sock)
                raise TransportError(f"engine {remote.engine_id} refused the read: {message}")
            self._recv_blocks(sock, local_block_ids, remote_block_ids, ranges)
            sock.sendall(_ACK)
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
            _recv_views(sock, _range_slices(self._layers, local_block_ids, self.layout.block_bytes,
                                            local_ranges))
            return
        runs = _paired_runs(local_block_ids, remote_block_ids)
        _recv_views(sock, _block_slices(self._layers, runs, self.layout.block_bytes))

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
        _configure(sock, self.timeout_s)
        with self._lock:
            self._active.add(sock)
        try:
            self._authenticate(sock)
        except BaseException:
            self._discard(sock)
            raise
        return sock, False

    def _authenticate(self, sock: socket.socket) -> None:
        magic, auth_required, server_nonce = _HELLO.unpack(_recv_bytes(sock, _HELLO.size))
        if magic != _MAGIC_HELLO:
            raise TransportError(f"peer is not a kvrelay TCP transport (hello {magic!r})")
        if not auth_required and self.secret is None:
            return
        if not auth_required:
            raise TransportError("peer does not authenticate but this side has a shared secret: refusing it")
        if self.secret is None:
            raise TransportError("peer requires a shared secret and this side has none")
        client_nonce = secrets.token_bytes(16)
        sock.sendall(_AUTH.pack(client_nonce, _proof(self.secret, b"D", server_nonce, client_nonce)))
        verdict = sock.recv(1)
        if verdict != b"\x00":
            raise TransportError("peer refused the shared secret (the secrets differ)")
        server_proof = _recv_bytes(sock, 32)
        if not hmac.compare_digest(server_proof, _proof(self.secret, b"P", client_nonce, server_nonce)):
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

"""The TCP transport's listening side: the data port of the instance whose blocks are accessed.

A prefill instance's data port answers READs (D pulls blocks out of P's KV tensors); a decode
instance's takes WRITs (P pushes blocks into D's), each only into blocks its write guard admits
(blocks a live push registration owns), so a late or stray write never lands in a block D
reused: a refused write's bytes are drained and the connection stays usable. An admitted write
is reported done to the guard whatever happens to it, so D can wait for the writes it admitted
before it gives blocks back. One thread accepts; one thread serves each connection. The wire
format is in wire.py.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import select
import socket
import struct
import threading
from collections import deque
from collections.abc import Sequence

from kvrelay.kv_transfer.transport.base import ByteRange, WriteGuard, check_write_ranges
from kvrelay.kv_transfer.transport.tcp import wire

logger = logging.getLogger(__name__)

_ACCEPT_POLL_S = 0.2


class BlockServer:
    """The data port: accepts connections, streams the blocks a READ asks for and takes the blocks a
    WRIT brings; queues each transfer's notification once the bytes are where they belong."""

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
            wire.configure(sock, self.timeout_s)
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
        sock.sendall(wire.HELLO.pack(wire.MAGIC_HELLO, self.secret is not None, server_nonce))
        if self.secret is None:
            return True
        client_nonce, client_proof = wire.AUTH.unpack(wire.recv_bytes(sock, wire.AUTH.size))
        if not hmac.compare_digest(client_proof, wire.proof(self.secret, b"D", server_nonce, client_nonce)):
            logger.warning("TCP transport: refused a connection from %s: wrong shared secret",
                           sock.getpeername())
            sock.sendall(b"\x01")
            return False
        sock.sendall(b"\x00" + wire.proof(self.secret, b"P", client_nonce, server_nonce))
        return True

    def _serve_one_read(self, sock: socket.socket) -> bool:
        """Answer one request (READ or WRIT); False when the peer hung up between requests or must
        be dropped."""
        # NOTE: an idle persistent connection waits for its next request without a timeout;
        # close() shuts it down.
        select.select([sock], [], [])
        header = sock.recv(wire.READ.size, socket.MSG_WAITALL)
        if not header:
            return False
        if len(header) < wire.READ.size:
            header += wire.recv_bytes(sock, wire.READ.size - len(header))
        magic, num_ids, notification_len = wire.READ.unpack(header)
        if magic in (wire.MAGIC_WRITE, wire.MAGIC_WRITE_RANGES):
            ranged = magic == wire.MAGIC_WRITE_RANGES
            return self._serve_one_write(sock, num_ids, notification_len, ranged=ranged)
        if magic not in (wire.MAGIC_READ, wire.MAGIC_READ_RANGES):
            raise ConnectionError(f"bad request magic {magic!r}")
        num_ranges = 0
        if magic == wire.MAGIC_READ_RANGES:
            (num_ranges,) = wire.NUM_RANGES.unpack(wire.recv_bytes(sock, wire.NUM_RANGES.size))
        problem = self._oversize(num_ids, notification_len, num_ranges)
        if problem is not None:  # NOTE: the request's body is not read, so the stream is lost
            wire.refuse(sock, problem)
            return False
        body = wire.recv_bytes(sock, 4 * num_ids + 8 * num_ranges + notification_len)
        block_ids = struct.unpack_from(f"!{num_ids}I", body)
        flat = struct.unpack_from(f"!{2 * num_ranges}I", body, 4 * num_ids)
        ranges = list(zip(flat[::2], flat[1::2], strict=True))  # (offset, length)
        notification = body[4 * num_ids + 8 * num_ranges:]
        problem = self._outside(block_ids, ranges)
        if problem is not None:
            wire.refuse(sock, problem)
            return True
        if magic == wire.MAGIC_READ:
            slices = wire.block_slices(self.layers, wire.runs(block_ids), self.block_bytes)
        else:
            slices = wire.range_slices(self.layers, block_ids, self.block_bytes, ranges)
        wire.send_views(sock, [memoryview(wire.STATUS.pack(0, 0)), *slices])
        if wire.recv_bytes(sock, 1) != wire.ACK:
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
        """Why a request header cannot be honoured before its body is even read, or None."""
        if not self.layers:
            return "this engine has registered no KV caches yet"
        if num_ids > self.num_blocks:
            return (f"a read of {num_ids} blocks is more than the whole pool of {self.num_blocks} "
                    "blocks")
        if num_ranges > wire.MAX_RANGES:
            return f"a read of {num_ranges} byte ranges per block is over the limit of {wire.MAX_RANGES}"
        if notification_len > wire.MAX_NOTIFICATION_BYTES:
            return (f"a notification of {notification_len} bytes is over the limit of "
                    f"{wire.MAX_NOTIFICATION_BYTES}")
        return None

    # ---------------------------------------------------------------- pushes into this side

    def _serve_one_write(self, sock: socket.socket, num_ids: int, notification_len: int,
                         ranged: bool = False) -> bool:
        """Take one WRIT (or WRNG) into this side's blocks if the write guard admits it. A refused
        write's bytes are drained, so the connection stays usable. False: drop the connection."""
        (num_layers,) = wire.LAYERS.unpack(wire.recv_bytes(sock, wire.LAYERS.size))
        num_ranges = wire.NUM_RANGES.unpack(wire.recv_bytes(sock, wire.NUM_RANGES.size))[0] if ranged else 0
        problem = self._oversize(num_ids, notification_len, num_ranges)
        if problem is None and num_layers > len(self.layers):
            problem = f"a write of {num_layers} layers is more than the {len(self.layers)} layers here"
        if problem is not None:  # NOTE: the body is not read, so the stream is lost
            wire.refuse(sock, problem)
            return False
        body = wire.recv_bytes(sock, 4 * (num_ids + num_layers) + 8 * num_ranges + notification_len)
        block_ids = struct.unpack_from(f"!{num_ids}I", body)
        layers = struct.unpack_from(f"!{num_layers}I", body, 4 * num_ids)
        flat = struct.unpack_from(f"!{2 * num_ranges}I", body, 4 * (num_ids + num_layers))
        ranges = list(zip(flat[::2], flat[1::2], strict=True)) if ranged else None  # (offset, length)
        notification = body[4 * (num_ids + num_layers) + 8 * num_ranges:]
        guard = self.write_guard
        problem = self._write_problem(block_ids, layers, ranges)
        if problem is None and guard is None:
            problem = "this engine accepts no pushed KV"
        if problem is None and guard is not None:
            problem = guard.admit(block_ids, notification, ranges)
        if problem is not None:
            per_block = self.block_bytes if ranges is None else sum(length for _, length in ranges)
            wire.drain(sock, num_ids * num_layers * per_block)
            wire.refuse(sock, problem)
            return True
        assert guard is not None
        try:
            chosen = [self.layers[layer] for layer in layers]
            if ranges is None:
                wire.recv_views(sock, wire.block_slices(chosen, wire.runs(block_ids), self.block_bytes))
            else:
                wire.recv_views(sock, wire.range_slices(chosen, block_ids, self.block_bytes, ranges))
            guard.landed(block_ids, layers, ranges)
            if notification:  # NOTE: queued before the guard hears "done": D sees it with the bytes
                self.notifications.append(notification)
        finally:
            guard.done(block_ids, notification, ranges)
        sock.sendall(wire.STATUS.pack(0, 0))
        return True

    def _write_problem(self, block_ids: Sequence[int], layers: Sequence[int],
                       ranges: Sequence[tuple[int, int]] | None) -> str | None:
        bad = [b for b in block_ids if b >= self.num_blocks]
        if bad:
            return f"block ids {bad[:8]} are outside the pool of {self.num_blocks} blocks"
        if any(layer >= len(self.layers) for layer in layers):
            return f"layer indices {list(layers)} are outside 0..{len(self.layers) - 1}"
        if len(set(block_ids)) != len(block_ids):
            return "a write names the same block twice"
        if ranges is not None:
            try:  # NOTE: only the receiver's offsets travel; the writer's side is checked there
                check_write_ranges([ByteRange(offset, 0, length) for offset, length in ranges],
                                   self.block_bytes, self.block_bytes)
            except ValueError as e:
                return str(e)
        return None

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

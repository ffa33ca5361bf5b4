"""The TCP transport's push: P writes blocks into D's KV tensors.

One write on one persistent connection, opened by the writer (P) to the receiver's data port:

    P -> D   WRIT header (block count, notification length, layer count), D's block ids, the
             layer indices, notification, then the blocks' bytes layer by layer
    D -> P   status once every byte sits in D's blocks (or why the write was refused: D's write
             guard admits only blocks it registered for a push); the notification is queued

The writer opens (or reuses) an authenticated connection to the receiver's data port and sends
one WRIT: header, D's block ids, the layer indices, the notification and the bytes, in one
vectored call. The receiver asks its write guard first: blocks that no live push registration
owns are refused and their bytes drained, so a late or stray write never lands in a block D
reused. An admitted write is reported done to the guard whatever happens to it, so D can wait
for the writes it admitted before it gives blocks back.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvrelay.kv_transfer.transport.base import (
    FinishedTransfer,
    TransferHandle,
    TransportError,
    check_layers,
    check_ranges,
    check_read,
)
from kvrelay.kv_transfer.transport.tcp import (
    _MAGIC_WRITE,
    _MAX_ERROR_BYTES,
    _READ,
    _STATUS,
    _block_slices,
    _recv_bytes,
    _recv_views,
    _runs,
    _send_views,
    _TcpRead,
)

if TYPE_CHECKING:
    from kvrelay.kv_transfer.transport.tcp import TcpTransport, _BlockServer, _Remote

_LAYERS = struct.Struct("!I")  # a WRIT header's layer count, after the READ-shaped part


def _drain(sock: socket.socket, size: int) -> None:
    """Receive and drop `size` bytes (a refused write's payload)."""
    scratch = memoryview(bytearray(min(size, 1 << 20)))
    while size:
        n = min(size, len(scratch))
        _recv_views(sock, [scratch[:n]])
        size -= n


def _write_problem(server: _BlockServer, block_ids: Sequence[int], layers: Sequence[int]) -> str | None:
    bad = [b for b in block_ids if b >= server.num_blocks]
    if bad:
        return f"block ids {bad[:8]} are outside the pool of {server.num_blocks} blocks"
    if any(layer >= len(server.layers) for layer in layers):
        return f"layer indices {list(layers)} are outside 0..{len(server.layers) - 1}"
    if len(set(block_ids)) != len(block_ids):
        return "a write names the same block twice"
    return None


def serve_one_write(server: _BlockServer, sock: socket.socket, num_ids: int, notification_len: int) -> bool:
    """D's side: take one WRIT into this side's blocks if the write guard admits it. A refused
    write's bytes are drained, so the connection stays usable. False: drop the connection."""
    (num_layers,) = _LAYERS.unpack(_recv_bytes(sock, _LAYERS.size))
    problem = server._oversize(num_ids, notification_len)
    if problem is None and num_layers > len(server.layers):
        problem = f"a write of {num_layers} layers is more than the {len(server.layers)} layers here"
    if problem is not None:  # NOTE: the body is not read, so the stream is lost
        server._refuse(sock, problem)
        return False
    body = _recv_bytes(sock, 4 * (num_ids + num_layers) + notification_len)
    block_ids = struct.unpack_from(f"!{num_ids}I", body)
    layers = struct.unpack_from(f"!{num_layers}I", body, 4 * num_ids)
    notification = body[4 * (num_ids + num_layers):]
    guard = server.write_guard
    problem = _write_problem(server, block_ids, layers)
    if problem is None and guard is None:
        problem = "this engine accepts no pushed KV"
    if problem is None and guard is not None:
        problem = guard.admit(block_ids, notification)
    if problem is not None:
        _drain(sock, num_ids * num_layers * server.block_bytes)
        server._refuse(sock, problem)
        return True
    assert guard is not None
    try:
        chosen = [server.layers[layer] for layer in layers]
        _recv_views(sock, _block_slices(chosen, _runs(block_ids), server.block_bytes))
        guard.landed(block_ids, layers)
        if notification:  # NOTE: queued before the guard hears "done": D sees it with the bytes
            server.notifications.append(notification)
    finally:
        guard.done(block_ids, notification)
    sock.sendall(_STATUS.pack(0, 0))
    return True


def start_write(transport: TcpTransport, remote_engine_id: str, local_block_ids: Sequence[int],
                remote_block_ids: Sequence[int], notification: bytes,
                layers: Sequence[int] | None) -> TransferHandle:
    """TcpTransport.write_blocks: check the request, then write on a pool thread."""
    remote = transport._remotes.get(remote_engine_id)
    if remote is None:
        return FinishedTransfer(f"unknown remote engine {remote_engine_id!r} (never added or removed)")
    if transport.layout is None:
        raise RuntimeError("register_kv_caches must come before write_blocks")
    check_read(local_block_ids, remote_block_ids, transport.layout.num_blocks, remote.layout.num_blocks)
    check_ranges(None, transport.layout.block_bytes, remote.layout.block_bytes)
    chosen = check_layers(layers, len(transport._layers))
    future = transport._pool.submit(send_write, transport, remote, list(local_block_ids),
                                    list(remote_block_ids), notification, chosen)
    return _TcpRead(future)


def send_write(transport: TcpTransport, remote: _Remote, local_block_ids: list[int],
               remote_block_ids: list[int], notification: bytes, layers: list[int]) -> None:
    """P's side, on a pool thread: one WRIT, and D's answer. Raises TransportError."""
    assert transport.layout is not None
    header = (_READ.pack(_MAGIC_WRITE, len(remote_block_ids), len(notification))
              + _LAYERS.pack(len(layers))
              + struct.pack(f"!{len(remote_block_ids)}I", *remote_block_ids)
              + struct.pack(f"!{len(layers)}I", *layers) + notification)
    chosen = [transport._layers[layer] for layer in layers]
    views = [memoryview(header), *_block_slices(chosen, _runs(local_block_ids), transport.layout.block_bytes)]
    # NOTE: unlike a read, a write is not retried on a fresh connection: its bytes may already
    # be in D's blocks, and only D's answer says what happened.
    sock, _ = transport._checkout(remote)
    try:
        _send_views(sock, views)
        status, message_len = _STATUS.unpack(_recv_bytes(sock, _STATUS.size))
        if status != 0:
            if message_len > _MAX_ERROR_BYTES:
                raise ConnectionError(f"peer announced a {message_len}-byte error message")
            message = _recv_bytes(sock, message_len).decode(errors="replace")
            transport._checkin(remote, sock)
            raise TransportError(f"engine {remote.engine_id} refused the write: {message}")
    except (OSError, ConnectionError) as e:
        transport._discard(sock)
        raise TransportError(f"write to engine {remote.engine_id} at {remote.address[0]}:"
                             f"{remote.address[1]} failed: {e}") from e
    transport._checkin(remote, sock)

"""The TCP transport's push: P writes blocks into D's KV tensors.

One write on one persistent connection, opened by the writer (P) to the receiver's data port:

    P -> D   WRIT header (block count, notification length, layer count), D's block ids, the
             layer indices, notification, then the blocks' bytes layer by layer
    D -> P   status once every byte sits in D's blocks (or why the write was refused: D's write
             guard admits only blocks it registered for a push); the notification is queued

A write of byte ranges (WRNG: a KV-head slice of each block, between instances of different TP
sizes) also sends the ranges' (receiver offset, length) after the layer indices; the bytes then
come layer by layer, block by block, range by range, and D lands each at its own offset.

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
    ByteRange,
    FinishedTransfer,
    TransferHandle,
    TransportError,
    check_layers,
    check_read,
    check_write_ranges,
)
from kvrelay.kv_transfer.transport.tcp import (
    _MAGIC_WRITE,
    _MAGIC_WRITE_RANGES,
    _MAX_ERROR_BYTES,
    _NUM_RANGES,
    _READ,
    _STATUS,
    _block_slices,
    _range_slices,
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


def _write_problem(server: _BlockServer, block_ids: Sequence[int], layers: Sequence[int],
                   ranges: Sequence[tuple[int, int]] | None) -> str | None:
    bad = [b for b in block_ids if b >= server.num_blocks]
    if bad:
        return f"block ids {bad[:8]} are outside the pool of {server.num_blocks} blocks"
    if any(layer >= len(server.layers) for layer in layers):
        return f"layer indices {list(layers)} are outside 0..{len(server.layers) - 1}"
    if len(set(block_ids)) != len(block_ids):
        return "a write names the same block twice"
    if ranges is not None:
        try:  # NOTE: only the receiver's offsets travel; the writer's side is checked there
            check_write_ranges([ByteRange(offset, 0, length) for offset, length in ranges],
                               server.block_bytes, server.block_bytes)
        except ValueError as e:
            return str(e)
    return None


def serve_one_write(server: _BlockServer, sock: socket.socket, num_ids: int, notification_len: int,
                    ranged: bool = False) -> bool:
    """D's side: take one WRIT (or WRNG) into this side's blocks if the write guard admits it. A
    refused write's bytes are drained, so the connection stays usable. False: drop the connection."""
    (num_layers,) = _LAYERS.unpack(_recv_bytes(sock, _LAYERS.size))
    num_ranges = _NUM_RANGES.unpack(_recv_bytes(sock, _NUM_RANGES.size))[0] if ranged else 0
    problem = server._oversize(num_ids, notification_len, num_ranges)
    if problem is None and num_layers > len(server.layers):
        problem = f"a write of {num_layers} layers is more than the {len(server.layers)} layers here"
    if problem is not None:  # NOTE: the body is not read, so the stream is lost
        server._refuse(sock, problem)
        return False
    body = _recv_bytes(sock, 4 * (num_ids + num_layers) + 8 * num_ranges + notification_len)
    block_ids = struct.unpack_from(f"!{num_ids}I", body)
    layers = struct.unpack_from(f"!{num_layers}I", body, 4 * num_ids)
    flat = struct.unpack_from(f"!{2 * num_ranges}I", body, 4 * (num_ids + num_layers))
    ranges = list(zip(flat[::2], flat[1::2], strict=True)) if ranged else None  # (offset, length)
    notification = body[4 * (num_ids + num_layers) + 8 * num_ranges:]
    guard = server.write_guard
    problem = _write_problem(server, block_ids, layers, ranges)
    if problem is None and guard is None:
        problem = "this engine accepts no pushed KV"
    if problem is None and guard is not None:
        problem = guard.admit(block_ids, notification, ranges)
    if problem is not None:
        per_block = server.block_bytes if ranges is None else sum(length for _, length in ranges)
        _drain(sock, num_ids * num_layers * per_block)
        server._refuse(sock, problem)
        return True
    assert guard is not None
    try:
        chosen = [server.layers[layer] for layer in layers]
        if ranges is None:
            _recv_views(sock, _block_slices(chosen, _runs(block_ids), server.block_bytes))
        else:
            _recv_views(sock, _range_slices(chosen, block_ids, server.block_bytes, ranges))
        guard.landed(block_ids, layers, ranges)
        if notification:  # NOTE: queued before the guard hears "done": D sees it with the bytes
            server.notifications.append(notification)
    finally:
        guard.done(block_ids, notification, ranges)
    sock.sendall(_STATUS.pack(0, 0))
    return True


def start_write(transport: TcpTransport, remote_engine_id: str, local_block_ids: Sequence[int],
                remote_block_ids: Sequence[int], notification: bytes,
                layers: Sequence[int] | None, ranges: Sequence[ByteRange] | None = None) -> TransferHandle:
    """TcpTransport.write_blocks: check the request, then write on a pool thread."""
    remote = transport._remotes.get(remote_engine_id)
    if remote is None:
        return FinishedTransfer(f"unknown remote engine {remote_engine_id!r} (never added or removed)")
    if transport.layout is None:
        raise RuntimeError("register_kv_caches must come before write_blocks")
    check_read(local_block_ids, remote_block_ids, transport.layout.num_blocks, remote.layout.num_blocks)
    checked = check_write_ranges(ranges, transport.layout.block_bytes, remote.layout.block_bytes)
    chosen = check_layers(layers, len(transport._layers))
    future = transport._pool.submit(send_write, transport, remote, list(local_block_ids),
                                    list(remote_block_ids), notification, chosen, checked)
    return _TcpRead(future)


def send_write(transport: TcpTransport, remote: _Remote, local_block_ids: list[int],
               remote_block_ids: list[int], notification: bytes, layers: list[int],
               ranges: list[ByteRange] | None = None) -> None:
    """P's side, on a pool thread: one WRIT (WRNG with ranges), and D's answer. Raises
    TransportError."""
    assert transport.layout is not None
    ids = (struct.pack(f"!{len(remote_block_ids)}I", *remote_block_ids)
           + struct.pack(f"!{len(layers)}I", *layers))
    chosen = [transport._layers[layer] for layer in layers]
    block_bytes = transport.layout.block_bytes
    if ranges is None:
        header = (_READ.pack(_MAGIC_WRITE, len(remote_block_ids), len(notification))
                  + _LAYERS.pack(len(layers)) + ids + notification)
        slices = _block_slices(chosen, _runs(local_block_ids), block_bytes)
    else:
        flat = [value for r in ranges for value in (r.remote_offset, r.length)]
        header = (_READ.pack(_MAGIC_WRITE_RANGES, len(remote_block_ids), len(notification))
                  + _LAYERS.pack(len(layers)) + _NUM_RANGES.pack(len(ranges)) + ids
                  + struct.pack(f"!{len(flat)}I", *flat) + notification)
        local_ranges = [(r.local_offset, r.length) for r in ranges]
        slices = _range_slices(chosen, local_block_ids, block_bytes, local_ranges)
    views = [memoryview(header), *slices]
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

"""The TCP transport's wire format, and the socket helpers both of its ends use.

Every connection starts with a HELLO from the side that listens (the one whose blocks are read
or written); with a shared secret, a mutual HMAC challenge-response follows (`proof`). Then any
number of requests, one at a time:

    READ  (D -> P)  header (block count, notification length), P's block ids, notification;
                    P answers a status, then for each layer in order the requested blocks
                    (adjacent block ids as one slice); D ACKs once every byte sits in its
                    blocks, and P queues the notification on the ACK
    RRNG            a READ of byte ranges of each block (a KV-head slice, between instances of
                    different TP sizes): the ranges (offset, length) follow the block ids, and
                    the bytes come layer by layer, block by block, range by range
    WRIT  (P -> D)  a push: header (block count, notification length, layer count), D's block
                    ids, the layer indices, notification, then the blocks' bytes layer by
                    layer; D answers a status once every byte sits in its blocks
    WRNG            a WRIT of byte ranges of each block (the receiver's offsets travel)

Bytes move between memoryviews over the KV tensors with vectored calls (`send_views`,
`recv_views`): a whole transfer costs a handful of system calls and no copy beyond the kernel's.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

HELLO = struct.Struct("!4sB16s")  # magic, auth required, server nonce
AUTH = struct.Struct("!16s32s")  # client nonce, client proof
READ = struct.Struct("!4sII")  # magic, number of blocks, notification length
STATUS = struct.Struct("!BI")  # 0 = OK / 1 = error, error message length
MAGIC_HELLO = b"KVR1"
MAGIC_READ = b"READ"
MAGIC_READ_RANGES = b"RRNG"  # a READ of byte ranges of each block
NUM_RANGES = struct.Struct("!I")
MAX_RANGES = 1024  # a head slice is two ranges (K and V); this bounds P's buffer
MAGIC_WRITE = b"WRIT"  # a push (WRIT)
MAGIC_WRITE_RANGES = b"WRNG"  # a push of byte ranges of each block
ACK = b"A"
MAX_NOTIFICATION_BYTES = 64 * 1024  # a notification is "{request_id}:{n}"; this bounds P's buffer
MAX_ERROR_BYTES = 64 * 1024  # and this D's, for P's reason of a refusal
# NOTE: Linux refuses more than IOV_MAX (1024) buffers in one sendmsg / recvmsg.
IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 16


LAYERS = struct.Struct("!I")  # a WRIT header's layer count, after the READ-shaped part


def proof(secret: bytes, role: bytes, first_nonce: bytes, second_nonce: bytes) -> bytes:
    return hmac.new(secret, role + first_nonce + second_nonce, hashlib.sha256).digest()


def consume(views: list[memoryview], first: int, num_bytes: int) -> int:
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


def send_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Send the views' bytes in order, IOV_MAX views a sendmsg. A blocking socket sends all it
    was given unless a timeout or a signal cuts the call short: then the rest goes next call."""
    pending = [v for v in views if len(v)]
    first = 0
    while first < len(pending):
        first = consume(pending, first, sock.sendmsg(pending[first:first + IOV_MAX]))


def recv_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill the views in order, IOV_MAX views a recvmsg_into. MSG_WAITALL makes the kernel wait
    until all of them are full, so a call returns early only on a timeout, a signal or a peer
    that closed; a peer that closes early is a ConnectionError."""
    pending = [v for v in views if len(v)]
    size, received, first = sum(len(v) for v in pending), 0, 0
    while first < len(pending):
        n = sock.recvmsg_into(pending[first:first + IOV_MAX], 0, socket.MSG_WAITALL)[0]
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {received} of {size} bytes")
        received += n
        first = consume(pending, first, n)


def recv_bytes(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    recv_views(sock, [memoryview(buf)])
    return bytes(buf)


def byte_view(kv: torch.Tensor) -> memoryview:
    """A writable byte view over a CPU tensor's storage (any dtype)."""
    import torch

    return memoryview(kv.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive ids, in order, as (first id, length)."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def paired_runs(local_block_ids: Sequence[int], remote_block_ids: Sequence[int]) -> list[tuple[int, int]]:
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


def block_slices(layers: Sequence[memoryview], runs: Sequence[tuple[int, int]],
                  block_bytes: int) -> list[memoryview]:
    """The byte slices of every run of blocks, layer by layer: the order of the stream."""
    return [layer[first * block_bytes:(first + length) * block_bytes]
            for layer in layers for first, length in runs]


def range_slices(layers: Sequence[memoryview], block_ids: Sequence[int], block_bytes: int,
                  ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
    """The (offset, length) ranges of every block, block by block, layer by layer: the order of
    a read by byte ranges."""
    return [layer[b * block_bytes + offset:b * block_bytes + offset + length]
            for layer in layers for b in block_ids for offset, length in ranges]


def configure(sock: socket.socket, timeout_s: float) -> None:
    """Blocking socket with kernel-side timeouts (SO_RCVTIMEO / SO_SNDTIMEO): a Python-level
    timeout would add a poll() syscall before every recv, a visible cost at loopback speeds.
    A timeout surfaces as an OSError (EAGAIN) like any other failure."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    timeval = struct.pack("ll", int(timeout_s), int((timeout_s % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def drain(sock: socket.socket, size: int) -> None:
    """Receive and drop `size` bytes (a refused write's payload)."""
    scratch = memoryview(bytearray(min(size, 1 << 20)))
    while size:
        n = min(size, len(scratch))
        recv_views(sock, [scratch[:n]])
        size -= n


def refuse(sock: socket.socket, problem: str) -> None:
    """Answer a request with an error status and the reason."""
    message = problem.encode()
    sock.sendall(STATUS.pack(1, len(message)) + message)

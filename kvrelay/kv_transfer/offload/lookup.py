"""The lookup channel: how the scheduler side asks the worker side what the store holds.

The two halves of a connector share no memory (they may live in different processes), and the
worker side owns the store: the host-memory tier, the LRU state, the writer queue. So the
scheduler side asks over a Unix socket, one small request at a time:

    ["lookup", [key, ...]]  ->  number of leading keys some tier holds
    ["pending"]             ->  chunk stores queued or in flight (waits up to a few ms for 0)

Frames are a 4-byte big-endian length and a msgpack body. The socket lives in a per-user
directory with mode 0700, so only this user's processes can connect. An unreachable worker
answers None: the scheduler side treats that as "nothing stored" and keeps serving.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import struct
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
_POLL_SECONDS = 0.5  # how often the server thread checks whether it should stop


def lookup_address(engine_id: str, extra_config: dict[str, Any], shard: str = "") -> str:
    """The socket path both halves of one connector derive from what they share. `shard`
    names one tensor-parallel rank's store (each rank's worker serves its own socket)."""
    directory = Path(tempfile.gettempdir()) / f"kvrelay-{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    identity = json.dumps([engine_id, extra_config] + ([shard] if shard else []), sort_keys=True,
                          default=str)
    return str(directory / f"offload-{hashlib.sha256(identity.encode()).hexdigest()[:24]}.sock")


def _send(sock: socket.socket, message: Any) -> None:
    body = msgspec.msgpack.encode(message)
    sock.sendall(_LENGTH.pack(len(body)) + body)


def _recv(sock: socket.socket) -> Any:
    (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    return msgspec.msgpack.decode(_recv_exactly(sock, length))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left:
        part = sock.recv(left)
        if not part:
            raise ConnectionError("the lookup peer closed the connection")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


class LookupServer:
    """Worker side: answers on `address` with `handle(message)` from a daemon thread.

    NOTE: the thread holds only `handle` (give it something that does not keep the worker
    alive) and stops within _POLL_SECONDS of close().
    """

    def __init__(self, address: str, handle: Callable[[list[Any]], Any]) -> None:
        self.address = address
        self._handle = handle
        self._stop = threading.Event()
        if os.path.exists(address):
            os.unlink(address)  # a previous process with the same engine id left it behind
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(address)
        self._listener.listen(4)
        self._listener.settimeout(_POLL_SECONDS)
        self._thread = threading.Thread(target=self._serve, name="kvrelay-offload-lookup", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break  # closed
            with conn:
                conn.settimeout(_POLL_SECONDS)
                self._serve_connection(conn)

    def _serve_connection(self, conn: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                message = _recv(conn)
            except TimeoutError:
                continue
            except (OSError, ConnectionError, msgspec.DecodeError):
                return
            try:
                answer = self._handle(message)
            except Exception:  # noqa: BLE001 - a bad question must not kill the channel
                logger.exception("offload lookup: cannot answer %r", message[:1])
                answer = None
            try:
                _send(conn, answer)
            except OSError:
                return

    def close(self) -> None:
        """Stop answering; the thread has ended when this returns (it polls every _POLL_SECONDS)."""
        self._stop.set()
        try:
            self._listener.close()
        finally:
            if os.path.exists(self.address):
                os.unlink(self.address)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10 * _POLL_SECONDS)


class LookupClient:
    """Scheduler side: one connection, opened on first use and reopened after a failure."""

    def __init__(self, address: str, timeout_seconds: float = 10.0) -> None:
        self.address = address
        self.timeout_seconds = timeout_seconds
        self._sock: socket.socket | None = None
        self._warned = False

    def ask(self, message: list[Any]) -> Any:
        """The worker's answer, or None when it cannot be reached (logged once)."""
        for attempt in range(2):  # a stale connection (worker restarted) gets one retry
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    self._sock.settimeout(self.timeout_seconds)
                    self._sock.connect(self.address)
                _send(self._sock, message)
                return _recv(self._sock)
            except (OSError, ConnectionError, msgspec.DecodeError) as e:
                self.close()
                if attempt and not self._warned:
                    self._warned = True
                    logger.warning("offload: the worker's store is unreachable at %s (%s); "
                                   "treating lookups as misses", self.address, e)
        return None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class ShardedLookupClient:
    """Scheduler side under tensor parallelism: one client per rank. A key counts as stored only
    when every rank's store holds its shard (the fewest leading keys wins); pending stores add up."""

    def __init__(self, clients: list[LookupClient]) -> None:
        self.clients = clients

    def ask(self, message: list[Any]) -> Any:
        answers = [client.ask(message) for client in self.clients]
        if any(not isinstance(answer, int) for answer in answers):
            return None  # a rank is unreachable: nothing counts as stored
        return min(answers) if message[0] == "lookup" else sum(answers)

    def close(self) -> None:
        for client in self.clients:
            client.close()

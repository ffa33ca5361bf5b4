"""Completion notifications over a kvrelay side channel, for transports whose data path carries
none (CUDA IPC copies): the owner runs an inbox, a reader posts to it from one sender thread
once its bytes are in place. The thread waits for the copy's event itself, so an engine that
polls its transfers late does not hold the owner's blocks longer. Every message is HMAC-signed
with the transport key (see kvrelay/kv_transfer/side_channel.py): a forged "done" would let P
reuse blocks a reader still copies.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Protocol

import msgspec
import zmq

from kvrelay.kv_transfer.side_channel import SideChannelClient, SideChannelError, SideChannelServer

logger = logging.getLogger(__name__)

PUBLIC_KEY = b"kvrelay transfer notifications, no secret configured"


class Settles(Protocol):
    """What a notification waits for: True once the bytes it announces are in place."""

    def query(self) -> bool: ...


class _Notify(msgspec.Struct, array_like=True):
    message: bytes


class _NotifyAck(msgspec.Struct, array_like=True):
    pass


class NotificationInbox:
    """The owner's end: a side channel on `host` (a free port) that queues what readers send."""

    def __init__(self, host: str, key: bytes, name: str) -> None:
        self._received: deque[bytes] = deque()
        self._server = SideChannelServer(host, 0, key, name, {"notify": self._on_notify})
        self.host, self.port = host, self._server.port

    def _on_notify(self, body: bytes) -> tuple[str, msgspec.Struct]:
        self._received.append(msgspec.msgpack.decode(body, type=_Notify).message)
        return "notified", _NotifyAck()

    def take(self) -> list[bytes]:
        """What arrived since the last call."""
        received = self._received
        return [received.popleft() for _ in range(len(received))]

    def close(self) -> None:
        self._server.close()


def _settles(after: Settles) -> bool:
    """Wait for `after`; False (nothing to announce) when the copy behind it failed."""
    try:
        while not after.query():
            time.sleep(0.0002)
    except Exception as e:  # a CUDA error surfaces here: the bytes never arrived
        logger.warning("a copy failed before its notification went out: %s", e)
        return False
    return True


class NotificationSender:
    """The reader's end: one thread that delivers notifications in order, one client per owner."""

    def __init__(self, key: bytes, timeout_s: float, name: str) -> None:
        self._key = key
        self._timeout_s = timeout_s
        self._queue: queue.Queue[tuple[str, int, bytes, Settles | None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def send(self, host: str, port: int, message: bytes, after: Settles | None = None) -> None:
        """Queue `message` for the inbox at host:port, to go once `after` settled (in queue
        order); returns at once."""
        self._queue.put((host, port, message, after))

    def _loop(self) -> None:
        ctx = zmq.Context()
        clients: dict[tuple[str, int], SideChannelClient] = {}
        try:
            while (item := self._queue.get()) is not None:
                host, port, message, after = item
                if after is not None and not _settles(after):
                    continue
                if (host, port) not in clients:
                    clients[host, port] = SideChannelClient(ctx, host, port, self._key)
                try:
                    clients[host, port].call("notify", _Notify(message), self._timeout_s)
                except SideChannelError as e:  # the bytes are here; the owner's lease frees its blocks
                    logger.warning("notification to %s:%d failed: %s", host, port, e)
                    clients.pop((host, port)).close()
        finally:
            for client in clients.values():
                client.close()
            ctx.term()

    def close(self) -> None:
        """Deliver what is queued (each within the timeout), then stop."""
        self._queue.put(None)
        self._thread.join(timeout=self._timeout_s + 5)

"""The side channel: small authenticated request/reply messages over ZMQ, beside the transport.

A prefill instance runs a `SideChannelServer` (a ROUTER socket on kv_ip:kv_port, one thread).
A decode instance talks to each prefill instance through one `PeerThread`, which owns a DEALER
socket (`SideChannelClient`) and runs the jobs the engine thread queues (handshake, pin, release)
plus periodic heartbeats; it never blocks the engine thread.

Every message, both ways, is an `Envelope` followed by an HMAC-SHA256 of it under the cluster's
channel key. The envelope carries a timestamp and a random nonce: the server refuses a stale
timestamp or a nonce it has seen (replay), and a reply names the nonce it answers, so neither side
accepts a message the other did not just make. The wire format (two or three ZMQ frames)::

    [identity (ROUTER side only)] msgpack(Envelope) hmac_sha256(channel_key, msgpack(Envelope))

A request that fails authentication is answered with an unsigned `auth_error` envelope, so the
caller can say why it was refused; an answer without a valid MAC is never trusted otherwise.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

logger = logging.getLogger(__name__)

REPLAY_WINDOW_S = 60.0
AUTH_ERROR = "auth_error"
ERROR = "error"


class Envelope(msgspec.Struct, array_like=True):
    kind: str  # "handshake", "pin", "heartbeat", "release", their replies, or an error
    body: bytes  # msgpack of the kind's Struct
    sent_at: float  # unix seconds
    nonce: bytes
    sender: str  # the sender's instance id ("" for a client)
    reply_to: bytes = b""  # the nonce of the request this answers


class SideChannelError(Exception):
    """The peer could not be reached, refused us, or failed authentication."""


def seal(key: bytes, envelope: Envelope) -> list[bytes]:
    payload = msgspec.msgpack.encode(envelope)
    return [payload, hmac.new(key, payload, hashlib.sha256).digest()]


def unseal(key: bytes, frames: list[bytes]) -> Envelope:
    """Decode and authenticate; raises SideChannelError on a bad MAC or a malformed message."""
    if len(frames) != 2:
        raise SideChannelError(f"malformed message: {len(frames)} frames")
    payload, mac = frames
    if not hmac.compare_digest(mac, hmac.new(key, payload, hashlib.sha256).digest()):
        raise SideChannelError("authentication failed")
    try:
        return msgspec.msgpack.decode(payload, type=Envelope)
    except msgspec.DecodeError as e:
        raise SideChannelError(f"malformed message: {e}") from None


def new_envelope(kind: str, body: msgspec.Struct | None, sender: str, reply_to: bytes = b"") -> Envelope:
    raw = msgspec.msgpack.encode(body) if body is not None else b""
    return Envelope(kind, raw, time.time(), os.urandom(16), sender, reply_to)


class ReplayGuard:
    """Refuses messages outside the time window and nonces seen within it."""

    def __init__(self, window_s: float = REPLAY_WINDOW_S) -> None:
        self.window_s = window_s
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def check(self, envelope: Envelope) -> str | None:
        now = time.time()
        while self._seen and next(iter(self._seen.values())) < now - self.window_s:
            self._seen.popitem(last=False)
        if abs(now - envelope.sent_at) > self.window_s:
            return f"stale message ({now - envelope.sent_at:+.0f} s; are the clocks in sync?)"
        if envelope.nonce in self._seen:
            return "replayed message"
        self._seen[envelope.nonce] = now
        return None


Handler = Callable[[bytes], tuple[str, msgspec.Struct]]


class SideChannelServer:
    """Answers side-channel requests on one thread. `handlers` maps a request kind to a function
    of the request body returning (reply kind, reply body); they run on the server thread."""

    def __init__(self, host: str, port: int, key: bytes, instance_id: str,
                 handlers: dict[str, Handler]) -> None:
        self.key = key
        self.instance_id = instance_id
        self.handlers = handlers
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        address = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        try:
            self._socket.bind(address)
        except zmq.ZMQError as e:
            self._socket.close()
            self._ctx.term()
            raise ValueError(f"cannot bind the KV side channel to {address}: {e}; "
                             "give each instance its own kv_port") from None
        # NOTE: port 0 asks the OS for a free port; `port` is the one actually bound.
        self.port = int(self._socket.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self._guard = ReplayGuard()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kv-side-channel-{port}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                identity, *frames = self._socket.recv_multipart()
                reply = self._answer(frames)
                self._socket.send_multipart([identity, *reply])
        finally:
            self._socket.close()

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        try:
            request = unseal(self.key, frames)
        except SideChannelError as e:
            logger.warning("KV side channel: refused a request: %s", e)
            refusal = Envelope(AUTH_ERROR, str(e).encode(), time.time(), os.urandom(16), self.instance_id)
            return [msgspec.msgpack.encode(refusal), b""]
        problem = self._guard.check(request)
        handler = self.handlers.get(request.kind)
        if problem is None and handler is None:
            problem = f"unknown request kind {request.kind!r}"
        if problem is not None:
            logger.warning("KV side channel: refused a %s request: %s", request.kind, problem)
            return seal(self.key, Envelope(ERROR, problem.encode(), time.time(), os.urandom(16),
                                           self.instance_id, request.nonce))
        assert handler is not None
        try:
            kind, body = handler(request.body)
        except Exception as e:  # a handler bug must not kill the side channel
            logger.exception("KV side channel: %s handler failed", request.kind)
            return seal(self.key, Envelope(ERROR, f"{type(e).__name__}: {e}".encode(), time.time(),
                                           os.urandom(16), self.instance_id, request.nonce))
        return seal(self.key, new_envelope(kind, body, self.instance_id, request.nonce))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.term()


class SideChannelClient:
    """One DEALER socket to one peer; `call` is a blocking request/reply with a timeout. Owned
    by a single thread (ZMQ sockets are not thread-safe)."""

    def __init__(self, ctx: zmq.Context, host: str, port: int, key: bytes,
                 stop: threading.Event | None = None) -> None:
        self.key = key
        self.stop = stop or threading.Event()  # set: every call gives up at once
        self.address = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        self._pending = new_envelope("", None, "")  # the request `receive` answers
        self._socket = ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.address)

    def call(self, kind: str, body: msgspec.Struct, timeout_s: float) -> Envelope:
        """Send a request, return the authenticated reply; SideChannelError on a timeout, a
        refusal or a reply that fails authentication."""
        self.send(kind, body)
        return self.receive(timeout_s)

    def send(self, kind: str, body: msgspec.Struct) -> None:
        """The first half of `call`: send the request (`receive` waits for its reply)."""
        self._pending = new_envelope(kind, body, "")
        self._socket.send_multipart(seal(self.key, self._pending))

    def receive(self, timeout_s: float) -> Envelope:
        """The second half of `call`: the authenticated reply to the last request sent."""
        request = self._pending
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or self.stop.is_set():
                raise SideChannelError(f"no answer from {self.address} within {timeout_s:.1f} s")
            if not self._socket.poll(min(left_ms, 100)):
                continue
            frames = self._socket.recv_multipart()
            reply = self._authenticated_reply(frames, request.nonce)
            if reply is not None:
                return reply

    def _authenticated_reply(self, frames: list[bytes], nonce: bytes) -> Envelope | None:
        if len(frames) == 2 and frames[1] == b"":
            try:
                refusal = msgspec.msgpack.decode(frames[0], type=Envelope)
            except msgspec.DecodeError:
                return None
            if refusal.kind == AUTH_ERROR:
                raise SideChannelError(
                    f"{self.address} refused us: {refusal.body.decode(errors='replace')} (do both "
                    "instances use the same KVRELAY_KV_SECRET / secret_file?)")
            return None
        try:
            reply = unseal(self.key, frames)
        except SideChannelError as e:
            raise SideChannelError(f"the answer from {self.address} failed authentication ({e}): "
                                   "is it a kvrelay instance with the same secret?") from None
        if reply.reply_to != nonce:
            return None  # a late answer to an earlier call that timed out
        if reply.kind == ERROR:
            raise SideChannelError(f"{self.address}: {reply.body.decode(errors='replace')}")
        return reply

    def close(self) -> None:
        self._socket.close()


Job = Callable[[SideChannelClient], None]


class PeerThread:
    """A thread that owns the side channel to one peer: runs queued jobs in order, and calls
    `heartbeat(client)` every `heartbeat_s` seconds when no job is waiting."""

    def __init__(self, ctx: zmq.Context, host: str, port: int, key: bytes, name: str,
                 heartbeat: Job, heartbeat_s: float) -> None:
        self.heartbeat_s = heartbeat_s
        self.stop = threading.Event()
        self._client_args = (ctx, host, port, key, self.stop)
        self._heartbeat = heartbeat
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        client = SideChannelClient(*self._client_args)
        next_beat = time.monotonic() + self.heartbeat_s
        try:
            while True:
                try:
                    job = self._jobs.get(timeout=max(0.0, next_beat - time.monotonic()))
                except queue.Empty:
                    job = self._heartbeat
                    next_beat = time.monotonic() + self.heartbeat_s
                if job is None or self.stop.is_set():
                    return
                try:
                    job(client)
                except Exception:  # a job reports its own failures; this is a bug guard
                    logger.exception("KV side channel job failed")
        finally:
            client.close()

    def close(self, timeout_s: float = 5.0) -> None:
        self.stop.set()
        self._jobs.put(None)
        self._thread.join(timeout=timeout_s)

    def is_alive(self) -> bool:
        return self._thread.is_alive()


def decode(body: bytes, type_: type[Any]) -> Any:
    return msgspec.msgpack.decode(body, type=type_)

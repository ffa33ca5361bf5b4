"""KVEventSubscriber: one background thread following the KV event streams of many instances.

For each source (an instance) it keeps a SUB socket on the instance's PUB endpoint and, when
the instance has one, a DEALER on its replay endpoint (zmq_publisher.py has the protocol). It
hands the sink every batch exactly once and in sequence order, and says so when it cannot:

    on_batch(source, seq, batch)   the next batch of that source's stream
    on_reset(source, reason)       what the sink knew of that source may be wrong from here on:
                                   "restarted" (the live sequence went back: a new publisher),
                                   "reconnected" (the connection dropped and came back: maybe
                                   a new process), "fell behind" (batches were lost for good:
                                   too old for the replay buffer, no replay endpoint, or the
                                   replay timed out)

A subscriber that starts, or whose connection comes back, asks for a replay from sequence 0, so
it rebuilds what the instance published before, as far back as the replay buffer reaches. While
a replay runs the live socket is not read: ZeroMQ holds those messages, which keeps the order.
Publishers of both shapes are followed: kvrelay's, and vLLM's (`--kv-events-config`, whose
replay replies carry the topic as an extra frame).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvrelay.kv_events.events import KVEventBatch, decode_batch
from kvrelay.kv_events.zmq_publisher import seq_bytes

logger = logging.getLogger(__name__)

_POLL_MS = 50
_MONITORED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


class EventSink(Protocol):
    def on_batch(self, source: str, seq: int, batch: KVEventBatch) -> None: ...

    def on_reset(self, source: str, reason: str) -> None: ...


@dataclass(frozen=True)
class StreamAddress:
    """Where one instance publishes: connectable addresses (no wildcard host)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


@dataclass
class StreamStats:
    batches: int = 0  # batches handed to the sink
    lost: int = 0  # batches known to be missing for good
    resets: int = 0
    undecodable: int = 0
    last_batch_at: float | None = None  # time.monotonic() of the latest batch
    replaying: bool = False
    connected: bool = False


Socket = zmq.Socket[Any]


@dataclass
class _Stream:
    source: str
    address: StreamAddress
    sub: Socket
    monitor: Socket
    replay: Socket | None = None
    last_seq: int | None = None  # the last sequence number handed to the sink
    live_last: int | None = None  # the last one seen on the live socket
    was_connected: bool = False
    replay_from: int | None = None  # set while a replay is under way
    replay_deadline: float = 0.0
    stash: list[tuple[int, bytes]] = field(default_factory=list)  # live messages held back
    stats: StreamStats = field(default_factory=StreamStats)

    def sockets(self) -> list[Socket]:
        return [s for s in (self.sub, self.monitor, self.replay) if s is not None]


class KVEventSubscriber:
    def __init__(self, sink: EventSink, replay_timeout_s: float = 2.0) -> None:
        self.sink = sink
        self.replay_timeout_s = replay_timeout_s
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._streams: dict[str, _Stream] = {}
        self._commands: queue.Queue[tuple[str, str, StreamAddress | None, threading.Event]] = queue.Queue()
        self._stop = threading.Event()
        self._wake = threading.Event()  # set with every command and by close()
        self._lock = threading.Lock()  # guards `_streams` and the stats read from other threads
        self._poller = zmq.Poller()  # NOTE: used by the thread only, like every socket
        self._thread = threading.Thread(target=self._run, name="kv-events-subscriber", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread

    def add(self, source: str, address: StreamAddress) -> None:
        """Follow `source` at `address` (replacing what it followed before under that name);
        returns once the subscription is made and its first replay asked for."""
        self._command("add", source, address)

    def remove(self, source: str) -> None:
        self._command("remove", source, None)

    def stats(self) -> dict[str, StreamStats]:
        with self._lock:
            return {source: StreamStats(**vars(s.stats)) for source, s in self._streams.items()}

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5.0)

    def _command(self, verb: str, source: str, address: StreamAddress | None) -> None:
        done = threading.Event()
        self._commands.put((verb, source, address, done))
        self._wake.set()
        if self._thread.is_alive():
            done.wait(timeout=5.0)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands()
                if not self._streams:
                    # NOTE: zmq's poll returns at once when no socket is registered: without this
                    # wait an idle subscriber spins, holding the GIL from every other thread.
                    self._wake.wait(_POLL_MS / 1000)
                    self._wake.clear()  # a command put before this is drained at the loop's top
                    continue
                ready = dict(self._poller.poll(_POLL_MS))
                for stream in list(self._streams.values()):
                    self._service(stream, ready)
        finally:
            for stream in self._streams.values():
                self._close(stream)

    def _service(self, stream: _Stream, ready: dict[Any, int]) -> None:
        if ready.get(stream.monitor):
            self._on_monitor_events(stream)
        if stream.replay is not None and ready.get(stream.replay):
            self._on_replay_frames(stream)
        if stream.replay_from is None and ready.get(stream.sub):
            self._on_live_frames(stream)
        if stream.replay_from is not None and time.monotonic() > stream.replay_deadline:
            self._replay_timed_out(stream)

    def _apply_commands(self) -> None:
        while True:
            try:
                verb, source, address, done = self._commands.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                old = self._streams.pop(source, None)
            if old is not None:
                self._close(old)
            if verb == "add" and address is not None:
                self._open(source, address)
            done.set()

    def _open(self, source: str, address: StreamAddress) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, address.topic.encode())
        monitor = sub.get_monitor_socket(_MONITORED)
        sub.connect(address.endpoint)
        stream = _Stream(source, address, sub, monitor)
        self._poller.register(sub, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)
        with self._lock:
            self._streams[source] = stream
        if address.replay_endpoint is not None:
            self._start_replay(stream, 0)  # what was published before we listened

    def _close(self, stream: _Stream) -> None:
        stream.sub.disable_monitor()
        for sock in stream.sockets():
            self._poller.unregister(sock)
            sock.close(linger=0)

    def _on_monitor_events(self, stream: _Stream) -> None:
        while stream.monitor.poll(0):
            event = recv_monitor_message(stream.monitor)["event"]
            with self._lock:
                stream.stats.connected = event == zmq.EVENT_HANDSHAKE_SUCCEEDED
            if event != zmq.EVENT_HANDSHAKE_SUCCEEDED:
                continue
            if stream.was_connected:  # back after a drop: the stream may be a new process's
                self._start_over(stream, "reconnected")
            stream.was_connected = True

    def _start_over(self, stream: _Stream, reason: str) -> None:
        """Forget the stream's position and rebuild it from the replay (if there is one)."""
        self._reset(stream, reason, 0)
        stream.last_seq = stream.live_last = None
        stream.stash = []
        if stream.address.replay_endpoint is not None:
            self._drop_replay_socket(stream)
            self._start_replay(stream, 0)

    # ------------------------------------------------------------------ live stream

    def _on_live_frames(self, stream: _Stream) -> None:
        while stream.replay_from is None:
            try:
                frames = stream.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                logger.warning("KV events from %s: ignored a message of %d frames", stream.source,
                               len(frames))
                continue
            self._on_live(stream, int.from_bytes(frames[1], "big", signed=True), frames[2])

    def _on_live(self, stream: _Stream, seq: int, payload: bytes) -> None:
        if stream.live_last is not None and seq <= stream.live_last:
            # NOTE: one publisher's live sequence only grows: going back means a new publisher.
            self._start_over(stream, "restarted")
            if stream.replay_from is not None:
                stream.stash.append((seq, payload))
                stream.live_last = seq
                return
        stream.live_last = seq
        last = stream.last_seq
        if last is not None and seq <= last:
            return  # a replay already delivered it
        expected = 0 if last is None else last + 1
        if seq > expected and last is not None and stream.address.replay_endpoint is not None:
            stream.stash.append((seq, payload))
            self._start_replay(stream, expected)
            return
        self._deliver(stream, seq, payload, expected)

    def _deliver(self, stream: _Stream, seq: int, payload: bytes, expected: int) -> None:
        """Hand one batch to the sink; a gap before it that nobody can fill is a reset first."""
        if stream.last_seq is not None and seq <= stream.last_seq:
            return
        if seq > expected:
            self._reset(stream, "fell behind", seq - expected)
        stream.last_seq = seq
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            with self._lock:
                stream.stats.undecodable += 1
            logger.warning("KV events from %s: batch %d does not decode (%s); treating it as lost",
                           stream.source, seq, e)
            self._reset(stream, "fell behind", 1)
            return
        with self._lock:
            stream.stats.batches += 1
            stream.stats.last_batch_at = time.monotonic()
        self.sink.on_batch(stream.source, seq, batch)

    def _reset(self, stream: _Stream, reason: str, num_lost: int) -> None:
        with self._lock:
            stream.stats.resets += 1
            stream.stats.lost += num_lost
        if reason == "fell behind":
            logger.warning("KV events from %s: %d batch(es) lost for good; its index restarts from here",
                           stream.source, num_lost)
        else:
            logger.info("KV events from %s: the stream %s; rebuilding from the replay", stream.source,
                        reason)
        self.sink.on_reset(stream.source, reason)

    # ------------------------------------------------------------------ replay

    def _start_replay(self, stream: _Stream, start_seq: int) -> None:
        if stream.replay is None:
            assert stream.address.replay_endpoint is not None
            stream.replay = self._ctx.socket(zmq.DEALER)
            stream.replay.setsockopt(zmq.LINGER, 0)
            stream.replay.connect(stream.address.replay_endpoint)
            self._poller.register(stream.replay, zmq.POLLIN)
        stream.replay.send_multipart((b"", seq_bytes(start_seq)))
        stream.replay_from = start_seq
        stream.replay_deadline = time.monotonic() + self.replay_timeout_s
        with self._lock:
            stream.stats.replaying = True

    def _on_replay_frames(self, stream: _Stream) -> None:
        while stream.replay is not None and stream.replay_from is not None:
            try:
                frames = stream.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = _replay_reply(frames)
            if reply is None:
                continue
            seq, payload = reply
            if seq < 0:  # the end marker
                self._finish_replay(stream)
                return
            expected = stream.replay_from if stream.last_seq is None else stream.last_seq + 1
            self._deliver(stream, seq, payload, expected)

    def _finish_replay(self, stream: _Stream) -> None:
        stream.replay_from = None
        with self._lock:
            stream.stats.replaying = False
        stash, stream.stash = stream.stash, []
        for seq, payload in stash:
            expected = 0 if stream.last_seq is None else stream.last_seq + 1
            self._deliver(stream, seq, payload, expected)

    def _replay_timed_out(self, stream: _Stream) -> None:
        logger.warning("KV events from %s: no replay answer from %s within %.1f s", stream.source,
                       stream.address.replay_endpoint, self.replay_timeout_s)
        self._drop_replay_socket(stream)  # a late answer must not be taken for the next request's
        self._finish_replay(stream)

    def _drop_replay_socket(self, stream: _Stream) -> None:
        if stream.replay is not None:
            self._poller.unregister(stream.replay)
            stream.replay.close(linger=0)
            stream.replay = None


def _replay_reply(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of one replay reply: `[b"", seq, payload]` (kvrelay, older vLLM) or
    `[b"", topic, seq, payload]` (vLLM 0.32 repeats the topic); the end marker has seq -1."""
    if len(frames) == 4:
        frames = [frames[0], frames[2], frames[3]]
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    return int.from_bytes(frames[1], "big", signed=True), frames[2]

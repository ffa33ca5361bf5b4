"""ZmqEventPublisher: KV event batches over a ZeroMQ PUB socket, with a replay buffer.

Wire protocol (vLLM's, so vLLM's subscribers and routers read it):

    PUB        multipart [topic, seq, payload]: seq is an 8-byte big-endian counter, one per
               batch, from 0; payload is the msgpack KVEventBatch (events.py)
    ROUTER     a subscriber that saw a gap in seq sends [b"", start_seq (8 bytes, big-endian)]
    (replay)   from a DEALER (a REQ socket adds the empty frame itself) and gets back
               [b"", seq, payload] for every buffered batch with seq >= start_seq, then the end
               marker [b"", -1 (8 bytes, signed), b""]

The last `buffer_steps` batches are kept for replay. A subscriber that asks for batches older
than that gets what is left: the first seq it receives is past the one it asked for, which is
how it learns that it fell behind and that its view of this instance is incomplete.

`publish` never blocks the engine step: it numbers the batch and queues it; a background thread
encodes and sends. When the queue is full the batch is dropped, but its sequence number stays
used, so subscribers see the gap (and the replay cannot fill it: they are told they fell behind).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import zmq

from kvrelay.kv_events.base import EventPublisher, NullEventPublisher
from kvrelay.kv_events.config import KVEventsConfig
from kvrelay.kv_events.events import KVEventBatch, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker
_POLL_S = 0.05  # how long the thread waits for a batch before it checks replay requests again
_DROP_LOG_EVERY_S = 60.0


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, ipc:// or inproc:// address; connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


class ZmqEventPublisher(EventPublisher):
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.num_published = 0  # batches sent (read by tests and stats)
        self.num_dropped = 0  # batches dropped because the queue was full
        self._seq = itertools.count()
        self._queue: queue.Queue[tuple[int, KVEventBatch]] = queue.Queue(config.max_queue_size)
        self._stop = threading.Event()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._last_drop_log = 0.0
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        # NOTE: the sockets are made here, so a bad or busy address fails the engine's start; from
        # the thread's start on, only the thread touches them.
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None  # type: ignore[type-arg]
        self._ipc_files: list[Path] = []  # the ipc:// socket files this publisher bound (it removes them)
        try:
            if binds(config.endpoint):
                self._bind(self._pub, config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._bind(self._replay, config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open {config.endpoint!r} / "
                             f"{config.replay_endpoint!r}: {e}") from None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        if self._closed:
            return
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        seq = next(self._seq)
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.num_dropped += 1
            now = time.monotonic()
            if now - self._last_drop_log > _DROP_LOG_EVERY_S:
                self._last_drop_log = now
                logger.warning("KV events: the publisher queue is full (%d batches); dropped batch %d "
                               "(%d so far). Subscribers will see the gap.", self.config.max_queue_size,
                               seq, self.num_dropped)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()  # the thread sends what is queued, then stops
        self._thread.join(timeout=5.0)
        if self._thread.is_alive():
            logger.warning("KV events: the publisher thread did not stop within 5 s")
            return  # it still owns the sockets; the process exit closes them
        self._close_sockets()

    def _bind(self, socket: zmq.Socket, endpoint: str) -> None:  # type: ignore[type-arg]
        socket.bind(endpoint)
        if endpoint.startswith("ipc://"):
            self._ipc_files.append(Path(endpoint.removeprefix("ipc://")))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        # NOTE: ZMQ leaves a bound ipc:// socket's file behind when it closes the socket.
        for path in self._ipc_files:
            path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            self._serve_replays()
            try:
                seq, batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            try:
                payload = encode_batch(batch)
                self._send(seq, payload)
            except (zmq.ZMQError, TypeError, ValueError):
                logger.exception("KV events: batch %d could not be sent", seq)
                continue
            self._buffer.append((seq, payload))
            self.num_published += 1

    def _send(self, seq: int, payload: bytes) -> None:
        self._pub.send_multipart((self._topic, seq_bytes(seq), payload))

    def _serve_replays(self) -> None:
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("KV events: ignored a malformed replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((client, b"", seq_bytes(seq), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))


def create_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0) -> EventPublisher:
    """The publisher `config` asks for: ZeroMQ, or the null one when events are off."""
    if config is None or not config.publishes:
        return NullEventPublisher()
    return ZmqEventPublisher(config, data_parallel_rank)

"""ZmqEventPublisher and KVEventSubscriber on ipc:// sockets: order, replay, restarts, losses."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrelay.kv_events import BlockStored, KVEventBatch, KVEventsConfig
from kvrelay.kv_events.subscriber import KVEventSubscriber, StreamAddress
from kvrelay.kv_events.zmq_publisher import ZmqEventPublisher, create_publisher
from tests.entrypoints.serve_process import free_port
from tests.kv_transfer.transport.helpers import wait_for


class RecordingSink:
    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.tags: list[int] = []  # the block_size field of each batch's event: which batch it was
        self.resets: list[str] = []
        self._lock = threading.Lock()

    def on_batch(self, source: str, seq: int, batch: KVEventBatch) -> None:
        with self._lock:
            self.seqs.append(seq)
            self.tags.extend(e.block_size for e in batch.events if isinstance(e, BlockStored))

    def on_reset(self, source: str, reason: str) -> None:
        with self._lock:
            self.resets.append(reason)


class LossyPublisher(ZmqEventPublisher):
    """Publishes like the real one, but the live stream loses the sequence numbers in `lose`
    (they still enter the replay buffer): a subscriber's view of a congested network."""

    lose: set[int] = set()

    def _send(self, seq: int, payload: bytes) -> None:
        if seq not in self.lose:
            super()._send(seq, payload)


def batch(tag: int) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=[BlockStored(block_hashes=[bytes([tag % 256]) * 32],
                                                    parent_block_hash=None, token_ids=[tag],
                                                    block_size=tag, lora_id=None, medium="GPU",
                                                    lora_name=None)])


@pytest.fixture
def config(tmp_path: Path) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/events",
                          replay_endpoint=f"ipc://{tmp_path}/replay", buffer_steps=100, topic="kv")


def address(config: KVEventsConfig) -> StreamAddress:
    return StreamAddress(config.endpoint, config.replay_endpoint, config.topic)


@pytest.fixture
def sink() -> Iterator[RecordingSink]:
    yield RecordingSink()


def publish_all(publisher: ZmqEventPublisher, tags: range) -> None:
    done = publisher.num_published + len(tags)
    for tag in tags:
        publisher.publish(batch(tag))
    wait_for(lambda: publisher.num_published >= done, what="the batches to be sent")


def test_a_subscriber_gets_every_batch_once_and_in_order(config: KVEventsConfig, sink: RecordingSink) -> None:
    publisher = ZmqEventPublisher(config)
    subscriber = KVEventSubscriber(sink)
    try:
        subscriber.add("p0", address(config))
        wait_for(lambda: not subscriber.stats()["p0"].replaying, what="the first replay")
        publish_all(publisher, range(1, 21))
        wait_for(lambda: len(sink.seqs) == 20, what="20 batches")
        assert sink.seqs == list(range(20)) and sink.tags == list(range(1, 21))
        assert sink.resets == [] and subscriber.stats()["p0"].lost == 0
    finally:
        subscriber.close()
        publisher.shutdown()


def test_shutdown_removes_the_ipc_socket_files_the_publisher_bound(config: KVEventsConfig,
                                                                   tmp_path: Path) -> None:
    publisher = ZmqEventPublisher(config)
    assert (tmp_path / "events").exists() and (tmp_path / "replay").exists()
    publisher.shutdown()
    assert not (tmp_path / "events").exists() and not (tmp_path / "replay").exists()


def test_a_subscriber_that_starts_late_or_restarts_rebuilds_from_the_replay(
        config: KVEventsConfig, sink: RecordingSink) -> None:
    publisher = ZmqEventPublisher(config)
    try:
        publish_all(publisher, range(1, 11))  # nobody listens yet
        first = KVEventSubscriber(sink)
        first.add("p0", address(config))
        wait_for(lambda: len(sink.seqs) == 10, what="the replayed history")
        first.close()
        publish_all(publisher, range(11, 16))  # while the subscriber is down
        again = RecordingSink()
        second = KVEventSubscriber(again)
        second.add("p0", address(config))
        wait_for(lambda: len(again.seqs) == 15, what="the history after a restart")
        assert again.tags == list(range(1, 16)) and again.resets == []
        second.close()
    finally:
        publisher.shutdown()


def test_a_gap_in_the_live_stream_is_filled_by_the_replay(config: KVEventsConfig,
                                                          sink: RecordingSink) -> None:
    publisher = LossyPublisher(config)
    publisher.lose = {3, 4, 5}
    subscriber = KVEventSubscriber(sink)
    try:
        subscriber.add("p0", address(config))
        wait_for(lambda: not subscriber.stats()["p0"].replaying, what="the first replay")
        publish_all(publisher, range(1, 11))
        wait_for(lambda: len(sink.seqs) == 10, what="every batch")
        assert sink.seqs == list(range(10)) and sink.resets == []
    finally:
        subscriber.close()
        publisher.shutdown()


def test_a_subscriber_that_fell_behind_the_replay_buffer_is_told_so(tmp_path: Path,
                                                                    sink: RecordingSink) -> None:
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/events",
                            replay_endpoint=f"ipc://{tmp_path}/replay", buffer_steps=3)
    publisher = LossyPublisher(config)
    publisher.lose = set(range(1, 8))  # seven batches lost live; the buffer keeps only three
    subscriber = KVEventSubscriber(sink)
    try:
        subscriber.add("p0", address(config))
        wait_for(lambda: not subscriber.stats()["p0"].replaying, what="the first replay")
        publish_all(publisher, range(1, 10))  # seqs 0..8, 1..7 lost live; the buffer holds 6, 7, 8
        wait_for(lambda: 8 in sink.seqs, what="the batch after the gap")
        assert sink.resets == ["fell behind"]
        assert subscriber.stats()["p0"].lost == 5  # seqs 1..5 are gone for good
        assert sink.seqs == [0, 6, 7, 8]
    finally:
        subscriber.close()
        publisher.shutdown()


def test_a_restarted_publisher_is_seen_as_a_new_stream(config: KVEventsConfig, sink: RecordingSink) -> None:
    subscriber = KVEventSubscriber(sink, replay_timeout_s=1.0)
    publisher = ZmqEventPublisher(config)
    try:
        subscriber.add("p0", address(config))
        wait_for(lambda: not subscriber.stats()["p0"].replaying, what="the first replay")
        publish_all(publisher, range(1, 6))
        wait_for(lambda: len(sink.seqs) == 5, what="the first publisher's batches")
        publisher.shutdown()
        publisher = ZmqEventPublisher(config)  # a new process: its sequence starts at 0 again
        publish_all(publisher, range(100, 103))
        wait_for(lambda: sink.tags[-1:] == [102], what="the new publisher's batches")
        assert sink.resets[:1] in (["restarted"], ["reconnected"])
        assert sink.tags == [1, 2, 3, 4, 5, 100, 101, 102]
    finally:
        subscriber.close()
        publisher.shutdown()


def test_without_a_replay_endpoint_a_gap_is_reported_as_lost(tmp_path: Path, sink: RecordingSink) -> None:
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/events")
    publisher = LossyPublisher(config)
    publisher.lose = {2}
    subscriber = KVEventSubscriber(sink)
    try:
        subscriber.add("p0", address(config))
        calls = 0

        def probe() -> list[int]:  # ZeroMQ's slow joiner: publish until a batch arrives
            nonlocal calls
            publisher.publish(batch(0))
            calls += 1
            return sink.seqs

        wait_for(probe, what="a first batch")
        wait_for(lambda: publisher.num_published == calls, what="the probes to be sent")
        publisher.lose = {calls + 1}  # of the next three (seqs calls..calls+2), the middle one
        publish_all(publisher, range(1, 4))
        wait_for(lambda: calls + 2 in sink.seqs, what="the batches after the gap")
        assert sink.resets[-1:] == ["fell behind"] and calls + 1 not in sink.seqs
    finally:
        subscriber.close()
        publisher.shutdown()


def test_a_full_queue_drops_batches_without_blocking_and_leaves_a_visible_gap(tmp_path: Path) -> None:
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/events",
                            max_queue_size=2)
    publisher = ZmqEventPublisher(config)
    publisher._stop.set()  # the thread drains what it has and stops: nothing leaves the queue now
    publisher._thread.join(timeout=5)
    for tag in range(5):
        publisher.publish(batch(tag))  # returns at once even though nobody drains the queue
    assert publisher.num_dropped == 3 and publisher._queue.qsize() == 2
    assert [seq for seq, _ in list(publisher._queue.queue)] == [0, 1]  # 2, 3, 4 left a gap
    publisher.shutdown()


def test_create_publisher_gives_the_null_one_when_events_are_off(tmp_path: Path) -> None:
    assert type(create_publisher(None)).__name__ == "NullEventPublisher"
    off = KVEventsConfig(enable_kv_cache_events=False, endpoint=f"ipc://{tmp_path}/x")
    assert type(create_publisher(off)).__name__ == "NullEventPublisher"
    null = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    assert type(create_publisher(null)).__name__ == "NullEventPublisher"


def test_an_address_that_cannot_be_bound_fails_at_start_naming_it(tmp_path: Path) -> None:
    replay = f"tcp://127.0.0.1:{free_port()}"
    first = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/a",
                                             replay_endpoint=replay))
    try:
        with pytest.raises(ValueError, match="cannot open"):  # the replay port is taken
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/b",
                                             replay_endpoint=replay))
    finally:
        first.shutdown()
        first.shutdown()  # idempotent


def test_the_config_takes_vllms_keys_and_refuses_others() -> None:
    config = KVEventsConfig.from_any('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
                                     '"replay_endpoint": "tcp://*:5558", "buffer_steps": 10, "hwm": 5, '
                                     '"max_queue_size": 7, "topic": "kv", "publisher": "zmq"}')
    assert config is not None and config.publishes and config.buffer_steps == 10
    assert KVEventsConfig.from_any({"enable_kv_cache_events": True}).publisher == "zmq"  # type: ignore[union-attr]
    assert KVEventsConfig.from_any({}).publisher == "null"  # type: ignore[union-attr]
    for bad, message in [('{"enable_kv_cache_events": 1}', "must be bool"),
                         ('{"bufer_steps": 3}', "unknown kv_events_config key"),
                         ('{"publisher": "kafka"}', "publisher must be one of"),
                         ('{"buffer_steps": 0}', "buffer_steps must be >= 1"),
                         ('{"endpoint": "localhost:5557"}', "ZeroMQ address"),
                         ("[1]", "must be a JSON object"), ("{", "not valid JSON")]:
        with pytest.raises(ValueError, match=message):
            KVEventsConfig.from_any(bad)


def test_an_idle_subscriber_waits_instead_of_spinning(monkeypatch: pytest.MonkeyPatch,
                                                      sink: RecordingSink) -> None:
    """With no stream to follow, zmq's poll returns at once; the loop must then wait, or it holds
    the GIL from every other thread of the process (a proxy with kv-aware routing and no
    instance publishing events slowed its own requests to a crawl)."""
    turns = 0
    apply = KVEventSubscriber._apply_commands

    def counted(self: KVEventSubscriber) -> None:
        nonlocal turns
        turns += 1
        apply(self)

    monkeypatch.setattr(KVEventSubscriber, "_apply_commands", counted)
    subscriber = KVEventSubscriber(sink)
    try:
        threading.Event().wait(0.5)
        assert 1 <= turns < 100  # about 10 turns of 50 ms; a spinning loop makes 100,000s
        subscriber.remove("nobody")  # a command still gets through at once
    finally:
        subscriber.close()
    assert not subscriber._thread.is_alive()


def test_a_vllm_publishers_replay_which_repeats_the_topic_rebuilds_the_history(
        tmp_path: Path, sink: RecordingSink) -> None:
    """vLLM 0.32's replay socket answers `[topic, seq, payload]` after the empty frame, and ends
    with `[b"", -1, b""]` after it: the history it sends is taken like kvrelay's."""
    import zmq

    from kvrelay.kv_events import encode_batch

    ctx = zmq.Context.instance()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind(f"ipc://{tmp_path}/vllm-pub")
    router.bind(f"ipc://{tmp_path}/vllm-replay")
    subscriber = KVEventSubscriber(sink)
    try:
        subscriber.add("v0", StreamAddress(f"ipc://{tmp_path}/vllm-pub", f"ipc://{tmp_path}/vllm-replay",
                                           "kv"))
        assert router.poll(5000), "no replay request"
        client, empty, start = router.recv_multipart()
        assert (empty, int.from_bytes(start, "big")) == (b"", 0)
        for seq in range(3):  # as vllm/distributed/kv_events.py ZmqEventPublisher._service_replay
            router.send_multipart((client, b"", b"kv", seq.to_bytes(8, "big"), encode_batch(batch(seq + 1))))
        router.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))
        wait_for(lambda: len(sink.seqs) == 3, what="the replayed history")
        assert sink.tags == [1, 2, 3] and sink.resets == []
        # the end marker comes after the history: the subscriber's thread may take it a moment later
        wait_for(lambda: not subscriber.stats()["v0"].replaying, what="the replay's end")
    finally:
        subscriber.close()
        pub.close(linger=0)
        router.close(linger=0)

"""The event stream on the wire, checked against fixtures written from vLLM's documented schema.

vLLM documents its KV events by the msgspec classes in `vllm/distributed/kv_events.py` and the
subscriber example (docs.vllm.ai, examples/features/kv_events): a batch is a msgpack *array*
[ts, events, data_parallel_rank]; since vllm-project/vllm#42892 each event is a msgpack *map*
tagged by its class name under "type", fields by name; fields that have a default are left out
while they hold it (omit_defaults), required ones are always written, None included. ZeroMQ
frames are [topic, 8-byte big-endian sequence number, payload]; a replay answers
[b"", seq, payload] per batch and ends with [b"", -1 (8-byte signed), b""].

The fixtures below are plain msgpack values (lists, dicts, bytes), not kvrelay's classes, so
these tests fail if kvrelay's encoding drifts from that schema.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
import zmq

from kvrelay.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    decode_batch,
    encode_batch,
)
from kvrelay.kv_events.zmq_publisher import END_SEQ, ZmqEventPublisher

H0, H1, H2 = (bytes([i]) * 32 for i in (1, 2, 3))

# One batch as vLLM documents it: [ts, [events...], data_parallel_rank].
FIXTURE = [
    1700000000.25,
    [
        {"type": "BlockStored", "block_hashes": [H0, H1], "parent_block_hash": None,
         "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU",
         "lora_name": None},
        {"type": "BlockStored", "block_hashes": [H2], "parent_block_hash": H1,
         "token_ids": [9, 9, 9, 9], "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [H0], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ],
    0,
]


def kvrelay_batch() -> KVEventBatch:
    return KVEventBatch(ts=1700000000.25, data_parallel_rank=0, events=[
        BlockStored(block_hashes=[H0, H1], parent_block_hash=None, token_ids=list(range(8)),
                    block_size=4, lora_id=None, medium="GPU", lora_name=None),
        BlockStored(block_hashes=[H2], parent_block_hash=H1, token_ids=[9, 9, 9, 9], block_size=4,
                    lora_id=None, medium="GPU", lora_name=None),
        BlockRemoved(block_hashes=[H0], medium="GPU"),
        AllBlocksCleared(),
    ])


def test_a_batch_encodes_to_vllms_documented_msgpack_shape() -> None:
    payload = encode_batch(kvrelay_batch())
    assert msgspec.msgpack.decode(payload) == FIXTURE
    assert payload[0] == 0x93  # a fixarray of three: the batch is positional
    assert payload[1] == 0xCB  # ts is a float64
    events = msgspec.msgpack.decode(payload)[1]
    assert all(isinstance(e, dict) and next(iter(e)) == "type" for e in events)  # tagged maps


def test_field_types_are_the_documented_ones() -> None:
    stored = msgspec.msgpack.decode(encode_batch(kvrelay_batch()))[1][0]
    assert isinstance(stored["block_hashes"][0], bytes)  # ExternalBlockHash = bytes | int
    assert all(isinstance(t, int) for t in stored["token_ids"])
    assert isinstance(stored["block_size"], int)
    assert {"lora_id", "medium", "lora_name"} <= set(stored)  # required fields, written as null
    assert "extra_keys" not in stored and "group_idx" not in stored  # defaults are left out


def test_the_documented_shape_decodes_into_kvrelays_classes() -> None:
    batch = decode_batch(msgspec.msgpack.encode(FIXTURE))
    assert batch == kvrelay_batch()


def test_what_current_vllm_writes_decodes_too() -> None:
    """vLLM also writes the fields it added later (extra_keys, group_idx, kv_cache_spec_kind)
    and 64-bit integer hashes: a kvrelay subscriber reads vLLM's stream."""
    vllm_batch = [1789095808.8, [{"type": "BlockStored", "block_hashes": [15760518052499183552],
                                  "parent_block_hash": None, "token_ids": list(range(16)),
                                  "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
                                  "extra_keys": [None], "group_idx": 0,
                                  "kv_cache_spec_kind": "full_attention"}], 0]
    (event,) = decode_batch(msgspec.msgpack.encode(vllm_batch)).events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [15760518052499183552] and event.group_idx == 0


def test_a_malformed_payload_is_refused() -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_batch(msgspec.msgpack.encode([1.0, [{"type": "BlockExploded"}], 0]))


def test_zmq_frames_and_the_replay_protocol_are_vllms(tmp_path: Path) -> None:
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/pub",
                            replay_endpoint=f"ipc://{tmp_path}/replay", topic="kv-events")
    publisher = ZmqEventPublisher(config)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.connect(config.endpoint)
    replay = ctx.socket(zmq.DEALER)
    replay.connect(config.replay_endpoint or "")
    try:
        for _ in range(3):
            publisher.publish(kvrelay_batch())
        deadline = time.monotonic() + 10
        while publisher.num_published < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        # The live stream may have started before the subscription took (ZeroMQ's slow joiner);
        # the replay has every batch: ask for the ones from seq 1 on.
        replay.send_multipart([b"", (1).to_bytes(8, "big")])
        answers = [replay.recv_multipart() for _ in range(3)]
        assert answers[:2] == [[b"", seq.to_bytes(8, "big"), encode_batch(kvrelay_batch())] for seq in (1, 2)]
        assert answers[2] == [b"", END_SEQ, b""] and END_SEQ == b"\xff" * 8
        publisher.publish(kvrelay_batch())
        seqs = []
        while 3 not in seqs:  # the live stream: whatever arrived of 0..2, then 3
            assert sub.poll(10_000)
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv-events" and len(seq) == 8
            assert msgspec.msgpack.decode(payload) == FIXTURE
            seqs.append(int.from_bytes(seq, "big"))
        assert seqs == list(range(seqs[0], 4))
    finally:
        sub.close(linger=0)
        replay.close(linger=0)
        publisher.shutdown()

"""The executor's wire format: what the scheduler sends and the workers answer survives msgpack
unchanged, connector metadata included, and nothing else (no pickle) can be smuggled in."""

from __future__ import annotations

import msgspec
import pytest

from kvrelay.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvrelay.executor.serial import (
    WorkerReply,
    decode_reply,
    decode_runner_output,
    decode_scheduler_output,
    encode_reply,
    encode_runner_output,
    encode_scheduler_output,
)
from kvrelay.kv_transfer.reference.example import ExampleConnectorMetadata, LoadSpec, SaveSpec
from kvrelay.outputs import KVConnectorOutput, ModelRunnerOutput, TokenLogprobs
from kvrelay.sampling_params import SamplingParams


def make_scheduler_output() -> SchedulerOutput:
    params = SamplingParams(temperature=0.7, top_k=5, seed=11, stop=["end"], logprobs=2, max_tokens=9)
    return SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("new", [1, 2, 3, 4, 5], [9], params, [4, 2], 4)],
        scheduled_cached_reqs=[CachedRequestData("old", [7], 12, [33])],
        num_scheduled_tokens={"old": 1, "new": 2},  # batch order matters
        total_num_scheduled_tokens=3, finished_req_ids={"gone"},
        kv_connector_metadata=ExampleConnectorMetadata(
            loads=[LoadSpec("new", "k1", [4, 2], 0)], saves=[SaveSpec("old", "k2", [7])]))


def test_scheduler_output_round_trips_with_connector_metadata() -> None:
    sched_out = make_scheduler_output()
    decoded = decode_scheduler_output(encode_scheduler_output(sched_out))
    assert decoded == sched_out
    assert list(decoded.num_scheduled_tokens) == ["old", "new"]
    assert isinstance(decoded.kv_connector_metadata, ExampleConnectorMetadata)


def test_runner_output_round_trips() -> None:
    output = ModelRunnerOutput(
        req_ids=["a", "b"], sampled_token_ids=[[3], []],
        logprobs=[TokenLogprobs([3, 4], [-0.25, -1.5], 1), None],
        kv_connector_output=KVConnectorOutput(finished_sending={"x"}, failed_recving={"y"},
                                              invalid_block_ids={5}, stats={"bytes_loaded": 64.0}))
    assert decode_runner_output(encode_runner_output(output)) == output


def test_reply_round_trips_and_garbage_is_refused() -> None:
    reply = WorkerReply(kind="error", rank=1, error="Traceback ...")
    assert decode_reply(encode_reply(reply)) == reply
    with pytest.raises(msgspec.DecodeError):
        decode_scheduler_output(b"\x80\x04not msgpack")  # a pickle header is just bad bytes here

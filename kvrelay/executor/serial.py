"""The executor's wire format: SchedulerOutput down to every worker, ModelRunnerOutput back up.

msgpack through msgspec, decoded by type (no pickle). The connector metadata, whose class is
the connector's own, travels as its `to_bytes()` and is rebuilt with `from_bytes` in the worker.
"""

from __future__ import annotations

import dataclasses

import msgspec

from kvrelay.core.sched_output import SchedulerOutput
from kvrelay.outputs import ModelRunnerOutput


class WorkerReply(msgspec.Struct, kw_only=True):
    """One message from a worker: `ready` after start-up (with the KV blocks it can hold),
    `kv_ready` once its cache exists, `output` after a step, `error` once."""

    kind: str  # "ready" | "kv_ready" | "output" | "error"
    rank: int
    output: bytes = b""  # an encoded ModelRunnerOutput (kind "output")
    error: str = ""  # a traceback (kind "error")
    num_blocks: int = 0  # kind "ready": the KV blocks this rank can hold


class InitKVCache(msgspec.Struct, array_like=True):
    """The engine's second start-up message: allocate this many blocks (every rank alike)."""

    num_blocks: int
    max_model_len: int


SHUTDOWN = b"shutdown"  # the messages to a worker that are not a SchedulerOutput
INIT_KV_CACHE = b"init_kv_cache:"  # followed by an encoded InitKVCache

_encoder = msgspec.msgpack.Encoder()
_sched_decoder = msgspec.msgpack.Decoder(SchedulerOutput)
_output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
_reply_decoder = msgspec.msgpack.Decoder(WorkerReply)
_init_decoder = msgspec.msgpack.Decoder(InitKVCache)


def encode_scheduler_output(sched_out: SchedulerOutput) -> bytes:
    metadata = sched_out.kv_connector_metadata
    if metadata is not None:
        sched_out = dataclasses.replace(sched_out, kv_connector_metadata=metadata.to_bytes())
    return _encoder.encode(sched_out)


def decode_scheduler_output(data: bytes) -> SchedulerOutput:
    sched_out = _sched_decoder.decode(data)
    if sched_out.kv_connector_metadata is not None:
        from kvrelay.kv_transfer.base import KVConnectorMetadata
        sched_out.kv_connector_metadata = KVConnectorMetadata.from_bytes(sched_out.kv_connector_metadata)
    return sched_out


def encode_runner_output(output: ModelRunnerOutput) -> bytes:
    return _encoder.encode(output)


def decode_runner_output(data: bytes) -> ModelRunnerOutput:
    return _output_decoder.decode(data)


def encode_init_kv_cache(num_blocks: int, max_model_len: int) -> bytes:
    return INIT_KV_CACHE + _encoder.encode(InitKVCache(num_blocks, max_model_len))


def decode_init_kv_cache(data: bytes) -> InitKVCache:
    if not data.startswith(INIT_KV_CACHE):
        raise ValueError(f"expected the KV cache size before the first step, got {data[:32]!r}")
    return _init_decoder.decode(data[len(INIT_KV_CACHE):])


def encode_reply(reply: WorkerReply) -> bytes:
    return _encoder.encode(reply)


def decode_reply(data: bytes) -> WorkerReply:
    return _reply_decoder.decode(data)

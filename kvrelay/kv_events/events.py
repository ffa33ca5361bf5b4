"""KV cache events in vLLM's wire shape: what a subscriber of any vLLM-aware router decodes.

One engine step's events travel as one batch:

    KVEventBatch  a msgpack array [ts, [event, ...], data_parallel_rank]
    event         a msgpack map tagged by class name under "type", fields by name, e.g.
                  {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": null,
                   "token_ids": [...], "block_size": 16, "lora_id": null, "medium": "GPU",
                   "lora_name": null}

(vLLM's current encoding: the batch stays positional, the events became tagged maps in
vllm-project/vllm#42892; fields with a default are left out while they hold it.)

Block hashes are the engine's own chained hashes (kvrelay.core.block_hash): 32-byte digests,
msgpack `bin`. vLLM's `ExternalBlockHash` is `bytes | int`, so a vLLM subscriber takes them as
they are; vLLM itself publishes integers by default (a digest's last 8 bytes), which this
module decodes too (the proxy follows vLLM instances).

`medium` names where the blocks live: "GPU" for an instance's own KV cache (vLLM's name for the
engine's cache, whatever the device), "CPU", "DISK", ... for offload tiers.
"""

from __future__ import annotations

from typing import Any

import msgspec

ExternalBlockHash = bytes | int

MEDIUM_GPU = "GPU"  # the instance's own KV cache (vLLM's name, also on a CPU-only instance)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float  # time.time() when the batch was published
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base class of the three events; the tag ("type") is the class name."""


class BlockStored(KVCacheEvent):
    """Full blocks that became findable by prefix lookup, a chain in token order."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None  # the block before the first one; None at the start
    token_ids: list[int]  # the blocks' tokens, len(block_hashes) * block_size of them
    block_size: int
    lora_id: int | None  # vLLM: deprecated in favour of lora_name; kvrelay has no LoRA (None)
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None  # vLLM: the secondary offload tier that stored it
    session_id: str | None = None  # vLLM: the session of the request that stored it


class BlockRemoved(KVCacheEvent):
    """Blocks that can no longer be found (evicted, or their KV was found invalid)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block of the instance is gone (a prefix-cache reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]


def encode_batch(batch: KVEventBatch) -> bytes:
    return msgspec.msgpack.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """The batch in `payload`; msgspec.DecodeError (a ValueError) when it is not one."""
    return msgspec.msgpack.decode(payload, type=KVEventBatch)

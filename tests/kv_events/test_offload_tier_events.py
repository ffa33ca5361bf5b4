"""The OffloadConnector's tiers publish their own medium: what cpu and disk hold, in block hashes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvrelay import LLM
from kvrelay.core.block_hash import hash_token_blocks
from kvrelay.kv_events import BlockRemoved, BlockStored, EventPublisher, KVEventBatch
from kvrelay.kv_transfer.offload import CpuTier, OffloadStats, TieredStore
from kvrelay.kv_transfer.offload.events import TierEvents
from kvrelay.kv_transfer.offload.meta import prompt_keys
from kvrelay.kv_transfer.offload.store import shard_key
from tests.kv_transfer.offload.helpers import BLOCK_SIZE, CHUNK_TOKENS, generate, offload_config, prompts_of
from tests.tiny import tiny_loaded_model

BLOCKS_PER_CHUNK = CHUNK_TOKENS // BLOCK_SIZE


class FakeClient:
    """One rank's lookup channel, answering ["events"] from a list the test fills."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def ask(self, message: list[Any]) -> Any:
        assert message == ["events"]
        events, self.events = self.events, []
        return events


def test_a_store_logs_its_local_tiers_puts_and_evictions_once_asked() -> None:
    store = TieredStore([CpuTier(capacity_bytes=250, stats=OffloadStats())], "fp", 100, OffloadStats())
    store.put("a", b"x" * 100)
    assert store.take_events() == []  # nobody asked before: nothing was kept
    store.put("b", b"x" * 100)
    store.put("c", b"x" * 100)  # over 250 bytes: "b"'s older neighbour "a" goes
    assert store.take_events() == [("cpu", "stored", "b"), ("cpu", "removed", "a"), ("cpu", "stored", "c")]
    store.remove(["b"])
    assert store.take_events() == [("cpu", "removed", "b")]


def test_chunks_become_events_in_block_hashes_once_every_rank_holds_them() -> None:
    tokens = list(range(1, 2 * CHUNK_TOKENS + 1))
    hashes = hash_token_blocks(tokens, BLOCK_SIZE)
    shards = ["tp2-rank0", "tp2-rank1"]
    clients = [FakeClient(), FakeClient()]
    events = TierEvents(clients, shards, BLOCK_SIZE)  # type: ignore[arg-type]
    events.saved("chunk1", hashes[BLOCKS_PER_CHUNK - 1], hashes[BLOCKS_PER_CHUNK:])
    clients[0].events = [("cpu", "stored", shard_key("chunk1", shards[0]))]
    assert events.take() == []  # rank 1 has not stored its shard yet
    clients[1].events = [("cpu", "stored", shard_key("chunk1", shards[1])),
                         ("cpu", "stored", "someone-elses-key")]
    (stored,) = events.take()
    assert isinstance(stored, BlockStored) and stored.medium == "CPU"
    assert stored.block_hashes == hashes[BLOCKS_PER_CHUNK:]
    assert stored.parent_block_hash == hashes[BLOCKS_PER_CHUNK - 1] and stored.block_size == BLOCK_SIZE
    clients[1].events = [("cpu", "removed", shard_key("chunk1", shards[1]))]  # one shard gone
    (removed,) = events.take()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == hashes[BLOCKS_PER_CHUNK:]


class RecordingPublisher(EventPublisher):
    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        pass


def test_an_engine_with_a_cpu_tier_publishes_its_chunks_as_cpu_blocks(tmp_path: Path) -> None:
    llm = LLM(loaded_model=tiny_loaded_model("llama"), num_blocks=128, block_size=BLOCK_SIZE,
              kv_transfer_config=offload_config(cpu_bytes=40_000),  # a few chunks: later ones evict
              kv_events_config={"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/ev"})
    publisher = RecordingPublisher()
    llm.engine.scheduler.kv_event_publisher.shutdown()
    llm.engine.scheduler.kv_event_publisher = publisher  # the same batches, read in the test
    try:
        prompts = prompts_of([3 * CHUNK_TOKENS + 3] * 6, seed=4)
        for prompt in prompts:  # one at a time, each one's stores landed before the next:
            generate(llm, [prompt])  # later prompts' chunks evict earlier ones
        events = [e for b in publisher.batches for e in b.events]
        cpu_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
        # Which chunks get stored, and in what order, depends on the worker's timing (a full
        # staging pool drops a store): every event must be one chunk of a prompt, in block
        # hashes, its parent the block before it (none for a first chunk).
        parents: dict[tuple[bytes, ...], bytes | None] = {}
        for prompt in prompts:
            hashes = hash_token_blocks(prompt, BLOCK_SIZE)
            for start in range(0, len(hashes) - BLOCKS_PER_CHUNK + 1, BLOCKS_PER_CHUNK):
                parents[tuple(hashes[start:start + BLOCKS_PER_CHUNK])] = hashes[start - 1] if start else None
        assert cpu_stored
        for event in cpu_stored:
            chunk = tuple(event.block_hashes)
            assert chunk in parents and event.parent_block_hash == parents[chunk] and event.token_ids == []
        assert any(event.parent_block_hash is None for event in cpu_stored)
        held: set[bytes] = set()
        for event in events:
            if isinstance(event, BlockStored) and event.medium == "CPU":
                held.update(event.block_hashes)  # type: ignore[arg-type]
            elif isinstance(event, BlockRemoved) and event.medium == "CPU":
                held.difference_update(event.block_hashes)  # type: ignore[arg-type]
        assert any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in events)  # evictions
        # The subscriber's view is the tier's content, exactly: a chunk's blocks are held iff the
        # tier holds the chunk.
        in_tier = set(llm.engine.runner.connector.worker.store.tiers[0].keys())
        fingerprint = llm.engine.scheduler.connector.scheduler.fingerprint
        expected: set[bytes] = set()
        for prompt in prompts:
            hashes = hash_token_blocks(prompt, BLOCK_SIZE)
            for c, key in enumerate(prompt_keys(prompt, CHUNK_TOKENS, fingerprint).chunks):
                if key in in_tier:
                    expected.update(hashes[c * BLOCKS_PER_CHUNK:(c + 1) * BLOCKS_PER_CHUNK])
        assert held == expected and len(held) > 0
        assert llm.engine.blocks_in_use == 0
    finally:
        llm.engine.shutdown()

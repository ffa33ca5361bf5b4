"""A real engine publishing over ZeroMQ: a subscriber's view equals the engine's prefix cache."""

from __future__ import annotations

import threading
from pathlib import Path

from kvrelay import LLM, SamplingParams
from kvrelay.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvrelay.kv_events.subscriber import KVEventSubscriber, StreamAddress
from tests.kv_transfer.transport.helpers import wait_for
from tests.tiny import tiny_loaded_model


class IndexSink:
    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.lock = threading.Lock()

    def on_batch(self, source: str, seq: int, batch: KVEventBatch) -> None:
        with self.lock:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self.held.update(event.block_hashes)  # type: ignore[arg-type]
                elif isinstance(event, BlockRemoved):
                    self.held.difference_update(event.block_hashes)  # type: ignore[arg-type]
                elif isinstance(event, AllBlocksCleared):
                    self.held.clear()

    def on_reset(self, source: str, reason: str) -> None:
        with self.lock:
            self.held.clear()


def test_an_engines_event_stream_rebuilds_its_prefix_cache_in_a_subscriber(tmp_path: Path) -> None:
    config = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/pub",
              "replay_endpoint": f"ipc://{tmp_path}/replay", "topic": "kv"}
    llm = LLM(loaded_model=tiny_loaded_model(), num_blocks=24, block_size=4, kv_events_config=config)
    sink = IndexSink()
    subscriber = KVEventSubscriber(sink)
    try:
        subscriber.add("engine", StreamAddress(config["endpoint"], config["replay_endpoint"], "kv"))
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        shared = list(range(10, 26))
        prompts = [{"prompt_token_ids": shared + [30 + i] * (3 + i)} for i in range(6)]  # evicts
        llm.generate(prompts, params, use_tqdm=False)
        pool = llm.engine.scheduler.kv_cache_manager.block_pool
        wait_for(lambda: sink.held == set(pool.cached_blocks), what="the subscriber to catch up")
        assert len(sink.held) > 4
        assert llm.engine.blocks_in_use == 0
    finally:
        subscriber.close()
        llm.engine.shutdown()

"""The scheduler's KV events: one batch per step, following the prefix cache's hash map."""

from __future__ import annotations

import random

from kvrelay.core.block_hash import hash_block_tokens
from kvrelay.core.scheduler import Scheduler
from kvrelay.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventPublisher, KVEventBatch
from tests.helpers import FakeRunner, make_config, make_request, run_to_completion

BLOCK_SIZE = 4


class RecordingPublisher(EventPublisher):
    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        pass

    @property
    def events(self) -> list[object]:
        return [e for b in self.batches for e in b.events]


def scheduler(num_blocks: int = 32) -> tuple[Scheduler, RecordingPublisher]:
    publisher = RecordingPublisher()
    return Scheduler(make_config(block_size=BLOCK_SIZE), num_blocks, 256, None, publisher), publisher


def index_from(events: list[object]) -> set[bytes]:
    """What a subscriber knows after applying `events` in order."""
    held: set[bytes] = set()
    for event in events:
        if isinstance(event, BlockStored):
            held.update(event.block_hashes)  # type: ignore[arg-type]
        elif isinstance(event, BlockRemoved):
            held.difference_update(event.block_hashes)  # type: ignore[arg-type]
        elif isinstance(event, AllBlocksCleared):
            held.clear()
    return held


def test_a_prompt_stores_its_full_blocks_as_one_chain_with_their_tokens() -> None:
    sched, publisher = scheduler()
    prompt = list(range(10, 20))  # two full blocks and two tokens
    request = make_request(prompt, max_tokens=1)
    sched.add_request(request)
    run_to_completion(sched, FakeRunner(BLOCK_SIZE))
    (stored,) = publisher.events
    assert isinstance(stored, BlockStored)
    first = hash_block_tokens(None, prompt[:4])
    assert stored.block_hashes == [first, hash_block_tokens(first, prompt[4:8])]
    assert stored.parent_block_hash is None and stored.token_ids == prompt[:8]
    assert (stored.block_size, stored.medium, stored.lora_id) == (BLOCK_SIZE, "GPU", None)
    assert sched.blocks_in_use == 0


def test_blocks_filled_by_output_tokens_chain_to_the_prompts_last_block() -> None:
    sched, publisher = scheduler()
    prompt = list(range(1, 7))  # one full block; output tokens fill the second
    sched.add_request(make_request(prompt, max_tokens=3))
    run_to_completion(sched, FakeRunner(BLOCK_SIZE))
    first, second = (e for e in publisher.events if isinstance(e, BlockStored))
    assert second.parent_block_hash == first.block_hashes[-1]
    assert len(second.token_ids) == BLOCK_SIZE and second.token_ids[:2] == prompt[4:6]
    assert sched.blocks_in_use == 0


def test_a_shared_prefix_is_stored_once_and_the_rest_chains_after_it() -> None:
    sched, publisher = scheduler()
    shared = list(range(1, 9))
    sched.add_request(make_request(shared + [50, 51, 52, 53, 54], max_tokens=1))
    run_to_completion(sched, FakeRunner(BLOCK_SIZE))
    before = len(publisher.events)
    sched.add_request(make_request(shared + [60, 61, 62, 63, 64], max_tokens=1))
    run_to_completion(sched, FakeRunner(BLOCK_SIZE))
    (stored,) = publisher.events[before:]
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash == hash_block_tokens(hash_block_tokens(None, shared[:4]), shared[4:])
    assert stored.token_ids == [60, 61, 62, 63]
    assert sched.blocks_in_use == 0


def test_evictions_are_removed_events_and_a_reset_is_published_at_once() -> None:
    sched, publisher = scheduler(num_blocks=6)
    for k in range(4):  # each prompt fills 3 blocks: later ones evict earlier ones' cached blocks
        sched.add_request(make_request([100 * k + i for i in range(1, 13)], max_tokens=1))
        run_to_completion(sched, FakeRunner(BLOCK_SIZE))
    assert any(isinstance(e, BlockRemoved) for e in publisher.events)
    assert index_from(publisher.events) == set(sched.kv_cache_manager.block_pool.cached_blocks)
    num_batches = len(publisher.batches)
    assert sched.reset_prefix_cache()
    assert len(publisher.batches) == num_batches + 1
    assert publisher.batches[-1].events == [AllBlocksCleared()]
    assert sched.blocks_in_use == 0


def test_the_events_replayed_always_equal_the_prefix_cache_step_by_step() -> None:
    """A subscriber's index rebuilt from the events is the pool's hash map after every step,
    under prefix sharing, eviction and preemption (a small pool, random prompts)."""
    rng = random.Random(7)
    sched, publisher = scheduler(num_blocks=12)
    runner = FakeRunner(BLOCK_SIZE)
    prefixes = [[rng.randrange(1, 900) for _ in range(8)] for _ in range(3)]
    for i in range(30):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 900) for _ in range(rng.randrange(1, 9))]
        sched.add_request(make_request(prompt, max_tokens=rng.randrange(1, 16), request_id=f"q{i}"))
        for _ in range(rng.randrange(1, 4)):
            out = sched.schedule()
            sched.update_from_output(out, runner.execute(out))
            assert index_from(publisher.events) == set(sched.kv_cache_manager.block_pool.cached_blocks)
    run_to_completion(sched, runner)
    assert index_from(publisher.events) == set(sched.kv_cache_manager.block_pool.cached_blocks)
    assert all(len(b.events) > 0 for b in publisher.batches)  # no empty batches
    assert any(isinstance(e, BlockRemoved) for e in publisher.events)  # eviction happened
    assert sched.stats.num_preemptions > 0  # and preemption
    assert sched.blocks_in_use == 0


def test_without_a_publisher_nothing_is_recorded() -> None:
    sched = Scheduler(make_config(block_size=BLOCK_SIZE), 32, 256)
    sched.add_request(make_request(list(range(1, 13)), max_tokens=2))
    run_to_completion(sched, FakeRunner(BLOCK_SIZE))
    assert sched.kv_cache_manager.take_events() == []
    assert sched.blocks_in_use == 0

"""A randomized progress test of the scheduler with a KV connector.

Each seed builds a small pool and a stream of requests that mix local prefills (some sharing
prefixes), asynchronous loads of varied sizes (part of the prompt, all of it, nothing past the
local hit), synchronous loads, load failures and invalid blocks under both failure policies,
blocks lent to a consumer (delay_free), preemptions (the pool is small) and aborts at random
moments. The runner simulates the KV content of every block slot, so a request that reads KV
that never arrived, arrived corrupt, or was overwritten by a late write is caught.

The properties: every request finishes (nothing wedges the scheduler), its tokens are the
model's tokens, no step reads bad KV, and the pool ends with zero blocks in use.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvrelay.core.sched_output import SchedulerOutput
from kvrelay.core.scheduler import Scheduler
from kvrelay.kv_transfer import KVTransferConfig
from kvrelay.outputs import KVConnectorOutput, ModelRunnerOutput
from kvrelay.request import Request, RequestStatus
from tests.core.connector_harness import finish, prompt, setup
from tests.core.connector_harness import step as harness_step
from tests.helpers import FakeRunner, expected_tokens, make_config, make_request

BLOCK_SIZE = 4
GARBAGE = -1  # what a slot holds when its KV arrived corrupt or not at all


@dataclass
class Load:
    req_id: str
    block_ids: list[int]
    start: int  # first token position the load writes (the end of the local prefix hit)
    num_tokens: int
    load_async: bool


@dataclass
class Plan:
    """What the outside world holds for one request."""

    available_tokens: int = 0  # leading prompt tokens that exist outside this instance
    load_async: bool = False
    outcome: str = "ok"  # "ok", "failed" (async only) or "invalid"
    invalid_early: bool = False  # report the invalid block before the load settles
    delay_free: bool = False  # a consumer reads this request's blocks after it finishes


class StressConnector:
    """The scheduler half of a connector whose loads the test world settles."""

    def __init__(self, plans: dict[str, Plan]) -> None:
        self.plans = plans
        self._asked: dict[str, int] = {}
        self._loads: list[Load] = []
        self.loading: set[str] = set()
        self.holding: set[str] = set()
        self.finished_calls: list[str] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        plan = self.plans[request.request_id]
        self._asked[request.request_id] = num_computed_tokens
        num_tokens = max(0, plan.available_tokens - num_computed_tokens)
        return num_tokens, plan.load_async and num_tokens > 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        plan = self.plans[request.request_id]
        self._loads.append(Load(request.request_id, list(block_ids), self._asked[request.request_id],
                                num_external_tokens, plan.load_async))
        if plan.load_async:
            self.loading.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> list[Load]:
        loads, self._loads = self._loads, []
        return loads

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.loading -= output.finished_recving | output.failed_recving
        self.holding -= output.finished_sending

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.finished_calls.append(request.request_id)
        delay = self.plans[request.request_id].delay_free and bool(block_ids)
        if delay:
            self.holding.add(request.request_id)
        return delay, None

    def has_pending_work(self) -> bool:
        return bool(self.loading or self.holding)


class KVRunner(FakeRunner):
    """FakeRunner that also keeps the content of every KV slot: a computed position holds its
    token, a loaded one the token the outside world sent (GARBAGE where it was corrupt). Every
    scheduled step first checks that the positions it attends to hold the right tokens.

    NOTE: a synchronous load lands and is found bad inside one step, so that step's forward
    reads it before anyone can know; such a read is allowed, but its sampled token must be
    dropped (`unknowing`, checked by the World)."""

    def __init__(self) -> None:
        super().__init__(BLOCK_SIZE)
        self.slots: dict[tuple[int, int], int] = {}
        self.bad_reads: list[str] = []
        self._reported_this_step: set[tuple[int, int]] = set()
        self.unknowing: set[str] = set()  # requests that read this step's bad sync load

    def write_load(self, load: Load, truth: list[int], corrupt_block: int | None,
                   reported_in_step: bool = False) -> None:
        for pos in range(load.start, load.start + load.num_tokens):
            slot = (load.block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE)
            bad = corrupt_block is not None and (corrupt_block == -1 or slot[0] == corrupt_block)
            self.slots[slot] = GARBAGE if bad else truth[pos]
            if bad and reported_in_step:
                self._reported_this_step.add(slot)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = super().execute(so)
        for req_id, num_new in so.num_scheduled_tokens.items():
            state = self.state[req_id]
            tokens, blocks, start = state["tokens"], state["blocks"], state["computed"]
            for pos in range(start):
                slot = (blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE)
                if self.slots.get(slot) == tokens[pos]:
                    continue
                if slot in self._reported_this_step:
                    self.unknowing.add(req_id)
                else:
                    self.bad_reads.append(f"{req_id} read bad KV at position {pos}")
                break
            for pos in range(start, start + num_new):
                self.slots[(blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE)] = tokens[pos]
        self._reported_this_step = set()
        return out


@dataclass
class World:
    """Drives one scenario: arrivals, aborts, and the outside world's side of every load."""

    rng: random.Random
    sched: Scheduler
    connector: StressConnector
    runner: KVRunner
    arrivals: list[tuple[int, Request]]
    requests: dict[str, Request] = field(default_factory=dict)
    finish_reasons: dict[str, list[str]] = field(default_factory=dict)
    in_flight: dict[str, tuple[Load, int]] = field(default_factory=dict)  # async load, due step
    releases: dict[str, int] = field(default_factory=dict)  # held request, step it is read

    def step(self, step: int) -> None:
        while self.arrivals and self.arrivals[0][0] <= step:
            req = self.arrivals.pop(0)[1]
            self.requests[req.request_id] = req
            self.sched.add_request(req)
        # NOTE: aborts stop with the arrivals: an abort frees blocks, which would mask a wedge.
        if self.arrivals and self.rng.random() < 0.1:
            live = [r for r in self.requests.values() if not r.is_finished]
            if live:
                self.sched.finish_requests(self.rng.choice(live).request_id, RequestStatus.FINISHED_ABORTED)
        so = self.sched.schedule()
        events = KVConnectorOutput()
        for load in so.kv_connector_metadata:
            self._start(load, step, events)
        self._settle_due(step, events)
        for req_id in list(self.connector.holding - set(self.releases)):
            self.releases[req_id] = step + self.rng.randint(0, 3)
        for req_id, due in list(self.releases.items()):
            if due <= step:
                events.finished_sending.add(req_id)
                del self.releases[req_id]
        self.runner.kv_out = [events]
        self.runner.unknowing = set()
        for out in self.sched.update_from_output(so, self.runner.execute(so)):
            if out.request_id in self.runner.unknowing and out.new_token_ids:
                self.runner.bad_reads.append(f"{out.request_id} kept a token computed on bad KV")
            if out.finish_reason is not None:
                self.finish_reasons.setdefault(out.request_id, []).append(out.finish_reason)

    def _start(self, load: Load, step: int, events: KVConnectorOutput) -> None:
        plan = self.connector.plans[load.req_id]
        if not load.load_async:  # lands inside this step, before the forward
            bad = self._corrupt_block(load) if plan.outcome == "invalid" else None
            self.runner.write_load(load, self.requests[load.req_id].all_token_ids, bad,
                                   reported_in_step=True)
            if bad is not None:
                events.invalid_block_ids.add(bad)
            return
        self.in_flight[load.req_id] = (load, step + self.rng.randint(0, 4))
        if plan.outcome == "invalid" and plan.invalid_early:
            events.invalid_block_ids.add(self._corrupt_block(load))

    def _settle_due(self, step: int, events: KVConnectorOutput) -> None:
        for req_id, (load, due) in list(self.in_flight.items()):
            if due > step:
                continue
            del self.in_flight[req_id]
            plan = self.connector.plans[req_id]
            truth = self.requests[req_id].all_token_ids
            if plan.outcome == "failed":
                self.runner.write_load(load, truth, corrupt_block=-1)
                events.failed_recving.add(req_id)
                continue
            bad = self._corrupt_block(load) if plan.outcome == "invalid" else None
            self.runner.write_load(load, truth, bad)
            if bad is not None:
                events.invalid_block_ids.add(bad)
            events.finished_recving.add(req_id)

    @staticmethod
    def _corrupt_block(load: Load) -> int:
        # Deterministic per load, so an early report and the settling write name the same block.
        first = load.start // BLOCK_SIZE
        last = (load.start + load.num_tokens - 1) // BLOCK_SIZE
        return load.block_ids[first + (len(load.req_id) + load.num_tokens) % (last - first + 1)]


def build_world(seed: int, policy: str) -> World:
    rng = random.Random(seed)
    num_blocks = rng.randint(6, 14)
    max_model_len = num_blocks * BLOCK_SIZE
    kv_transfer = KVTransferConfig.from_any({"kv_connector": "ExampleConnector",
                                             "kv_load_failure_policy": policy})
    config = make_config(block_size=BLOCK_SIZE, max_num_seqs=rng.randint(2, 6),
                         max_num_batched_tokens=rng.choice([6, 8, 16, 32]),
                         long_prefill_token_threshold=rng.choice([0, 0, 5]), kv_transfer=kv_transfer)
    plans: dict[str, Plan] = {}
    connector = StressConnector(plans)
    sched = Scheduler(config, num_blocks, max_model_len, connector)
    prefixes = [[rng.randint(1, 999) for _ in range(rng.randint(1, 3) * BLOCK_SIZE)] for _ in range(3)]
    arrivals = []
    step = 0
    for i in range(rng.randint(6, 16)):
        max_tokens = rng.randint(1, 6)
        num_prompt = rng.randint(1, max_model_len - max_tokens)
        head = rng.choice(prefixes)[:num_prompt] if rng.random() < 0.4 else []
        prompt = head + [rng.randint(1, 999) for _ in range(num_prompt - len(head))]
        req = make_request(prompt, max_tokens=max_tokens, request_id=f"s{seed}-{i}")
        kind = rng.choice(["local", "async", "async", "sync"])
        plan = Plan(delay_free=rng.random() < 0.2)
        if kind != "local":
            plan.available_tokens = rng.choice([num_prompt, rng.randint(0, num_prompt)])
            plan.load_async = kind == "async"
            outcomes = ["ok", "ok", "invalid"] + (["failed"] if plan.load_async else [])
            plan.outcome = rng.choice(outcomes)
            plan.invalid_early = rng.random() < 0.5
        plans[req.request_id] = plan
        arrivals.append((step, req))
        step += rng.choice([0, 0, 1, 2])
    return World(rng, sched, connector, KVRunner(), arrivals)


def test_two_partial_async_loads_cannot_wedge_a_small_pool():
    # Each prompt needs 5 of the 7 blocks but only 12 of its 20 tokens exist outside. Admitting
    # both loads would leave each holding 3 blocks and needing 2 more once its load settled,
    # with 1 free and nothing running to free more. The second waits until the first has run.
    sched, conn, runner = setup(num_blocks=7, auto_finish_recving_after=1)
    a = make_request(prompt(20, 100), request_id="a", max_tokens=2)
    b = make_request(prompt(20, 500), request_id="b", max_tokens=2)
    for req in (a, b):
        conn.set_external_tokens(12, load_async=True, request_id=req.request_id)
        sched.add_request(req)
    harness_step(sched, runner)
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS and b.status == RequestStatus.WAITING
    assert sched.kv_cache_manager.num_reserved_blocks == 2
    finish(sched, runner)
    for req in (a, b):
        assert req.output_token_ids == expected_tokens(req.prompt_token_ids, 2)
        assert req.num_external_tokens == 12


SEEDS = range(150)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_every_request_finishes_and_the_pool_drains(policy):
    wedged = []
    seen: dict[str, int] = {}
    for seed in SEEDS:
        world = build_world(seed, policy)
        for step in range(600):
            if not world.arrivals and not world.sched.has_pending_work():
                break
            world.step(step)
        else:
            sched = world.sched
            wedged.append(f"seed {seed}: {sched.num_running} running, {sched.num_waiting} waiting, "
                          f"{sched.num_waiting_for_remote_kv} loading, {sched.blocks_in_use} blocks held")
            continue
        check_outcome(seed, policy, world)
        count_what_happened(world, seen)
    assert not wedged, "the scheduler stopped making progress:\n" + "\n".join(wedged)
    # The scenarios really exercise what they claim to.
    assert min(seen.values()) > 0 and len(seen) == 7, seen


def count_what_happened(world: World, seen: dict[str, int]) -> None:
    stats = world.sched.stats
    reasons = [r for rs in world.finish_reasons.values() for r in rs]
    plans = world.connector.plans.values()
    for name, n in [("preemptions", stats.num_preemptions), ("load failures", stats.kv_load_failures),
                    ("aborts", reasons.count("abort")), ("finished", reasons.count("length")),
                    ("external tokens", stats.prompt_tokens_external),
                    ("cached tokens", stats.prompt_tokens_cached),
                    ("held blocks", sum(p.delay_free for p in plans))]:
        seen[name] = seen.get(name, 0) + n


def check_outcome(seed: int, policy: str, world: World) -> None:
    where = f"seed {seed}, policy {policy}"
    assert world.runner.bad_reads == [], f"{where}: {world.runner.bad_reads}"
    assert world.sched.blocks_in_use == 0, f"{where}: blocks leaked"
    for req_id, req in world.requests.items():
        reasons = world.finish_reasons.get(req_id, [])
        assert len(reasons) == 1, f"{where}: {req_id} finished {reasons}"
        assert world.connector.finished_calls.count(req_id) == 1, f"{where}: {req_id} request_finished"
        if reasons[0] == "length":
            assert req.output_token_ids == expected_tokens(req.prompt_token_ids, len(req.output_token_ids))
            assert len(req.output_token_ids) == req.sampling_params.max_tokens
        elif reasons[0] == "error":
            assert policy == "fail" and world.connector.plans[req_id].outcome != "ok", where
        else:
            assert reasons[0] == "abort", f"{where}: {req_id} finished with {reasons[0]}"

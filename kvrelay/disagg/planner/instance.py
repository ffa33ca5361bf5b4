"""One simulated kvrelay instance: the scheduler's policy stepped against a latency model.

Each step hands out a token budget (max_num_batched_tokens) to running requests first, then to
waiting ones in arrival order (chunked prefill: a prompt takes what is left of the budget);
when blocks run out the most recently admitted running request is preempted (its blocks freed,
recomputed later). A decode instance admits a request whose KV comes from a prefill instance by
allocating its blocks without budget, waits for the transfer, then computes the last prompt
token (the minus-one rule), which yields the first output token.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from kvrelay.disagg.planner.pool import BlockPool
from kvrelay.disagg.planner.profile import Profile
from kvrelay.disagg.planner.workload import RequestSpec


class Role(enum.Enum):
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


class State(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # decode side: blocks held, KV on its way
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False)
class SimRequest:
    index: int
    spec: RequestSpec
    state: State = State.WAITING
    num_computed: int = 0
    num_generated: int = 0
    private_blocks: int = 0
    chunks: list[int] = field(default_factory=list)  # cached chunk ids this request holds
    published: bool = False
    remote: bool = False  # decode side: KV comes from a prefill instance
    loaded: bool = False
    hit_tokens: int = 0  # prompt tokens found in this instance's prefix cache
    first_token_s: float | None = None
    finish_s: float | None = None
    prefill_done_s: float | None = None
    preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV the request needs: the prompt plus every token generated so far."""
        return self.spec.input_len + self.num_generated


@dataclass
class StepPlan:
    scheduled: list[tuple[SimRequest, int]]
    loads: list[SimRequest]  # decode side: admitted, their transfers start now

    @property
    def has_compute(self) -> bool:
        return bool(self.scheduled)


class Instance:
    def __init__(self, name: str, role: Role, profile: Profile, chunk_tokens: int, prefix_cache: bool,
                 max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.name = name
        self.role = role
        self.profile = profile
        self.pool = BlockPool(profile.num_blocks, profile.block_size, chunk_tokens, prefix_cache)
        self.budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.busy = False
        self.in_flight = 0  # requests the proxy has outstanding here (its routing signal)
        self.num_preemptions = 0

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.pool.block_size

    # ----------------------------------------------------------------------------- schedule
    def schedule(self) -> StepPlan:
        plan = StepPlan([], [])
        budget, preempted = self._schedule_running(plan, self.budget)
        if not preempted:
            self._schedule_waiting(plan, budget)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int) -> tuple[int, bool]:
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed, budget)
            while not self._grow(req, req.num_computed + num_new):
                victim = self.running.pop()  # the most recently admitted: lowest priority
                self._preempt(victim, plan)
                preempted = True
                if victim is req:
                    return budget, preempted
            plan.scheduled.append((req, num_new))
            budget -= num_new
            i += 1
        return budget, preempted

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        out_of_blocks = False
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if req.state == State.LOADING:
                continue  # keeps its queue position, lets others pass
            if out_of_blocks and not req.loaded:
                continue  # a request out of blocks is passed only by those holding theirs
            admitted = self._admit(req, plan, budget)
            if admitted is None:
                out_of_blocks = True
                continue
            budget -= admitted

    def _admit(self, req: SimRequest, plan: StepPlan, budget: int) -> int | None:
        if req.loaded:  # its KV arrived: compute the last prompt token
            num_new = req.num_tokens - req.num_computed
        else:
            hit = self.pool.match(req.spec.hash_ids, req.num_tokens - 1)
            hit_tokens = len(hit) * self.pool.chunk_tokens
            target = req.num_tokens if req.remote else hit_tokens + min(req.num_tokens - hit_tokens, budget)
            self.pool.acquire(hit)  # before allocating, so the allocation cannot evict the hit
            if not self.pool.allocate(self.pool.blocks_for(target) - len(hit) * self.pool.chunk_blocks):
                self.pool.release(hit)
                return None
            req.chunks, req.hit_tokens = hit, hit_tokens
            req.private_blocks = self.pool.blocks_for(target) - len(hit) * self.pool.chunk_blocks
            req.num_computed = hit_tokens
            if req.remote:
                req.state = State.LOADING
                plan.loads.append(req)
                return 0
            num_new = target - hit_tokens
        self.waiting.remove(req)
        req.state = State.RUNNING
        self.running.append(req)
        plan.scheduled.append((req, num_new))
        return num_new

    def _grow(self, req: SimRequest, num_tokens: int) -> bool:
        """Hold blocks for `num_tokens` tokens of `req`; False (nothing changed) if out of blocks."""
        held = len(req.chunks) * self.pool.chunk_blocks + req.private_blocks
        needed = self.pool.blocks_for(num_tokens) - held
        if needed <= 0:
            return True
        if not self.pool.allocate(needed):
            return False
        req.private_blocks += needed
        return True

    def _preempt(self, req: SimRequest, plan: StepPlan) -> None:
        plan.scheduled = [(r, n) for r, n in plan.scheduled if r is not req]
        self.release_blocks(req)
        req.state = State.WAITING
        req.num_computed = 0
        req.loaded = False
        req.remote = False  # its KV here is gone: recomputed locally
        req.published = False
        req.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def release_blocks(self, req: SimRequest) -> None:
        self.pool.free(req.private_blocks)
        self.pool.release(req.chunks)
        req.private_blocks, req.chunks = 0, []

    # ----------------------------------------------------------------------------- results
    def step_ms(self, plan: StepPlan) -> float:
        chunks, decodes = [], []
        for req, n in plan.scheduled:
            if n == 1:  # a decode, or a decode instance's first step after the KV arrived
                decodes.append(req.num_computed)
            else:
                chunks.append((n, req.num_computed))
        return self.profile.step_ms(chunks, decodes)

    @staticmethod
    def step_kind(plan: StepPlan) -> str:
        """"prefill" when the step computes a prompt chunk of more than one token (the profile's
        prefill fit times it), else "decode"."""
        return "prefill" if any(n != 1 for _, n in plan.scheduled) else "decode"

    def finish_step(self, plan: StepPlan, now: float) -> list[SimRequest]:
        """Apply a step's results; returns the requests that produced a token this step."""
        produced = []
        for req, n in plan.scheduled:
            req.num_computed += n
            if req.num_computed < req.num_tokens:
                continue
            self._publish(req)
            req.num_generated += 1
            produced.append(req)
        return produced

    def _publish(self, req: SimRequest) -> None:
        if req.published:
            return
        req.published = True
        full = req.spec.input_len // self.pool.chunk_tokens
        new = [h for h in req.spec.hash_ids[:full] if h not in req.chunks]
        moved = self.pool.publish(new)
        req.chunks = req.chunks + moved
        req.private_blocks -= len(moved) * self.pool.chunk_blocks

    def remove(self, req: SimRequest) -> None:
        """A request leaves this instance (finished here, or handed to a decode instance)."""
        if req in self.running:
            self.running.remove(req)
        req.state = State.DONE

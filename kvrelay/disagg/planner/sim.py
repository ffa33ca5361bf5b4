"""The cluster simulator: arrivals, the proxy's routing, instances stepping, KV transfers.

A small heap-based event loop (time, sequence number, callback). Instances step whenever they
have work; a step's length comes from the profile's latency model. In an xPyD cluster the
proxy sends each request to the prefill instance with the fewest requests in flight (ties
round-robin, as kvrelay's proxy does), the prefill instance keeps the blocks until the decode
instance has read them, and each read waits for its link (one FIFO link per prefill instance
by default: concurrent reads from one P share its bandwidth by queueing).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvrelay.disagg.planner.instance import Instance, Role, SimRequest, State
from kvrelay.disagg.planner.profile import Profile
from kvrelay.disagg.planner.workload import Workload

LINK_SCOPES = ("per-prefill", "per-pair", "shared")


@dataclass(frozen=True)
class ClusterSpec:
    num_colocated: int = 0
    num_prefill: int = 0
    num_decode: int = 0

    def __post_init__(self) -> None:
        counts = (self.num_colocated, self.num_prefill, self.num_decode)
        if min(counts) < 0:
            raise ValueError(f"instance counts must be >= 0, got {counts}")
        pd = self.num_prefill > 0 and self.num_decode > 0
        if (self.num_colocated > 0) == pd or (not pd and (self.num_prefill or self.num_decode)):
            raise ValueError(f"a cluster is N colocated instances or xPyD with x, y >= 1, got "
                             f"{self.num_colocated} colocated, {self.num_prefill}P{self.num_decode}D")

    @property
    def disaggregated(self) -> bool:
        return self.num_prefill > 0

    @property
    def num_instances(self) -> int:
        return self.num_colocated + self.num_prefill + self.num_decode

    @property
    def label(self) -> str:
        if self.disaggregated:
            return f"{self.num_prefill}P{self.num_decode}D"
        return f"{self.num_colocated}x colocated"


@dataclass(frozen=True)
class SimOptions:
    prefix_cache: bool = True
    max_num_batched_tokens: int | None = None  # None: the profile's
    max_num_seqs: int | None = None
    backend: str | None = None  # transfer backend in the profile; None: nixl if measured, else tcp
    link_bandwidth_gbs: float | None = None  # GB/s: overrides the profile's transfer fit
    link_latency_ms: float = 0.0
    link_scope: str = "per-prefill"
    shared_host: bool = False  # all instances on one machine: steps slow down while others compute

    def __post_init__(self) -> None:
        if self.link_scope not in LINK_SCOPES:
            raise ValueError(f"link scope must be one of {', '.join(LINK_SCOPES)}, got {self.link_scope!r}")
        if self.link_bandwidth_gbs is not None and self.link_bandwidth_gbs <= 0:
            raise ValueError(f"--link-bandwidth must be > 0 GB/s, got {self.link_bandwidth_gbs}")


@dataclass
class SimResult:
    ttft_s: list[float]  # per request, in arrival order; inf for a request no instance can hold
    tpot_s: list[float]  # mean time per output token after the first
    num_rejected: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    transfer_bytes: float = 0.0
    end_s: float = 0.0


class _Link:
    def __init__(self) -> None:
        self.free_at = 0.0


class _Pool:
    """A role's instances and the proxy's pick among them."""

    def __init__(self, instances: list[Instance]) -> None:
        self.instances = instances
        self._turn = itertools.count()

    def pick(self) -> Instance:
        start = next(self._turn) % len(self.instances)
        rotated = self.instances[start:] + self.instances[:start]
        return min(rotated, key=lambda i: i.in_flight)


@dataclass
class _Step:
    """A step in progress on a shared host: `work_ms` of it (at the alone speed) is left as of
    `since`; it advances at `rate`; only the completion event carrying `token` is current."""
    inst: Instance
    plan: Any
    kind: str
    work_ms: float
    since: float
    rate: float = 1.0
    token: int = 0


@dataclass
class _Transfer:
    p_instance: Instance
    p_request: SimRequest
    link_key: Any = None


class ClusterSim:
    def __init__(self, cluster: ClusterSpec, profile: Profile, workload: Workload,
                 options: SimOptions | None = None, pd_profile: Profile | None = None) -> None:
        self.cluster, self.options, self.workload = cluster, options or SimOptions(), workload
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self._links: dict[Any, _Link] = {}
        self._transfers: dict[int, _Transfer] = {}
        self._running: dict[str, _Step] = {}  # shared host: steps in progress, by instance name
        self._tokens = itertools.count(1)
        self.requests = [SimRequest(i, spec) for i, spec in enumerate(workload.requests)]
        self.result = SimResult([math.inf] * len(self.requests), [math.inf] * len(self.requests))
        make = self._instance_factory(workload.hash_block_tokens)
        if cluster.disaggregated:
            prof = pd_profile or profile
            self.front = _Pool([make(f"P{i}", Role.PREFILL, prof) for i in range(cluster.num_prefill)])
            self.back: _Pool | None = _Pool([make(f"D{i}", Role.DECODE, prof)
                                             for i in range(cluster.num_decode)])
            self._transfer_ms = self._transfer_model(prof)
            self._pd_hop_s = prof.overhead_ms.get("pd_hop", 0.0) / 1e3
        else:
            self.front = _Pool([make(f"C{i}", Role.COLOCATED, profile) for i in range(cluster.num_colocated)])
            self.back = None
        self._request_overhead_s = self.front.instances[0].profile.overhead_ms.get("request", 0.0) / 1e3

    def _instance_factory(self, chunk_tokens: int) -> Callable[[str, Role, Profile], Instance]:
        def make(name: str, role: Role, prof: Profile) -> Instance:
            budget = self.options.max_num_batched_tokens or prof.engine["max_num_batched_tokens"]
            seqs = self.options.max_num_seqs or prof.engine["max_num_seqs"]
            return Instance(name, role, prof, chunk_tokens, self.options.prefix_cache, budget, seqs)
        return make

    def _transfer_model(self, prof: Profile) -> Callable[[float], float]:
        opts = self.options
        if opts.link_bandwidth_gbs is not None:
            per_byte_ms = 1e3 / (opts.link_bandwidth_gbs * 1e9)
            return lambda n: opts.link_latency_ms + n * per_byte_ms if n > 0 else 0.0
        backend = opts.backend or ("nixl" if "nixl" in prof.transfer else "tcp")
        if backend not in prof.transfer:
            raise ValueError(f"profile of {prof.model} has no KV transfer measurement (backend {backend!r}); "
                             "give the link with --link-bandwidth GB/s")
        return lambda n: prof.transfer_ms(n, backend)

    # ----------------------------------------------------------------------------- event loop
    def at(self, time_s: float, callback: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._events, (time_s, next(self._seq), callback, args))

    def run(self) -> SimResult:
        for req in self.requests:
            self.at(req.spec.arrival_s, self._arrive, req)
        while self._events:
            self.now, _, callback, args = heapq.heappop(self._events)
            callback(*args)
        self.result.end_s = self.now
        self.result.num_preemptions = sum(i.num_preemptions for i in self._all_instances())
        return self.result

    def _all_instances(self) -> list[Instance]:
        return self.front.instances + (self.back.instances if self.back else [])

    # ----------------------------------------------------------------------------- requests
    def _fits(self, req: SimRequest, inst: Instance) -> bool:
        max_len = inst.profile.engine.get("max_model_len")
        total = req.spec.input_len + req.spec.output_len
        if max_len is not None and req.spec.input_len >= max_len:
            return False
        return inst.pool.blocks_for(total) <= inst.pool.num_blocks

    def _arrive(self, req: SimRequest) -> None:
        inst = self.front.pick()
        if not self._fits(req, inst) or (self.back and not self._fits(req, self.back.instances[0])):
            self.result.num_rejected += 1  # the server answers 400: never within any SLO
            return
        self.result.prompt_tokens += req.spec.input_len
        inst.in_flight += 1
        self.at(self.now + self._request_overhead_s, self._enqueue, inst, req)

    def _enqueue(self, inst: Instance, req: SimRequest) -> None:
        inst.waiting.append(req)
        self._kick(inst)

    def _kick(self, inst: Instance) -> None:
        if inst.busy:
            return
        plan = inst.schedule()
        for req in plan.loads:
            self._start_transfer(inst, req)
        if not plan.has_compute:
            return
        inst.busy = True
        if not self.options.shared_host:
            self.at(self.now + inst.step_ms(plan) / 1e3, self._step_done, inst, plan)
            return
        self._settle()
        self._running[inst.name] = _Step(inst, plan, inst.step_kind(plan), inst.step_ms(plan), self.now)
        self._replan()

    # NOTE: shared host. A step's remaining work shrinks at its rate; the rates change only
    # when a step starts or ends, so settling then and re-planning every end is exact.
    def _settle(self) -> None:
        for step in self._running.values():
            step.work_ms = max(0.0, step.work_ms - (self.now - step.since) * 1e3 * step.rate)
            step.since = self.now

    def _replan(self) -> None:
        crowded = len(self._running) > 1
        for step in self._running.values():
            slowdown = step.inst.profile.co_run_slowdown.get(step.kind, 1.0) if crowded else 1.0
            step.rate, step.token = 1.0 / slowdown, next(self._tokens)
            self.at(self.now + step.work_ms / step.rate / 1e3, self._shared_step_done, step.inst, step.token)

    def _shared_step_done(self, inst: Instance, token: int) -> None:
        step = self._running.get(inst.name)
        if step is None or step.token != token:
            return  # re-planned since: a later event ends it
        self._settle()
        del self._running[inst.name]
        self._replan()
        self._step_done(inst, step.plan)

    def _step_done(self, inst: Instance, plan: Any) -> None:
        inst.busy = False
        for req in inst.finish_step(plan, self.now):
            if req.num_generated == 1 and req.hit_tokens and not req.remote:
                self.result.prefix_hit_tokens += req.hit_tokens
            if inst.role == Role.PREFILL:
                self._prefill_done(inst, req)
            else:
                self._token(inst, req)
        self._kick(inst)

    def _token(self, inst: Instance, req: SimRequest) -> None:
        if req.num_generated == 1:
            req.first_token_s = self.now
        if req.num_generated < req.spec.output_len:
            return
        inst.remove(req)
        inst.release_blocks(req)
        inst.in_flight -= 1
        req.finish_s = self.now
        first = req.first_token_s if req.first_token_s is not None else self.now
        self.result.ttft_s[req.index] = first - req.spec.arrival_s
        gaps = req.spec.output_len - 1
        self.result.tpot_s[req.index] = (self.now - first) / gaps if gaps else 0.0

    # ----------------------------------------------------------------------------- P/D
    def _prefill_done(self, p_inst: Instance, p_req: SimRequest) -> None:
        # P's token is discarded; P holds the blocks (delay_free) until D has read them.
        p_req.prefill_done_s = self.now
        p_inst.remove(p_req)
        p_inst.in_flight -= 1
        self.at(self.now + self._pd_hop_s, self._to_decode, p_inst, p_req)

    def _to_decode(self, p_inst: Instance, p_req: SimRequest) -> None:
        assert self.back is not None
        d_inst = self.back.pick()
        d_req = SimRequest(p_req.index, p_req.spec, remote=True)
        self._transfers[id(d_req)] = _Transfer(p_inst, p_req, self._link_key(p_inst, d_inst))
        d_inst.in_flight += 1
        self._enqueue(d_inst, d_req)

    def _link_key(self, p_inst: Instance, d_inst: Instance) -> Any:
        scope = self.options.link_scope
        if scope == "shared":
            return "all"
        return p_inst.name if scope == "per-prefill" else (p_inst.name, d_inst.name)

    def _start_transfer(self, d_inst: Instance, d_req: SimRequest) -> None:
        transfer = self._transfers[id(d_req)]
        num_bytes = (d_req.spec.input_len - d_req.hit_tokens) * d_inst.profile.kv_bytes_per_token
        self.result.transfer_bytes += num_bytes
        self.result.prefix_hit_tokens += d_req.hit_tokens
        link = self._links.setdefault(transfer.link_key, _Link())
        start = max(self.now, link.free_at)
        link.free_at = start + self._transfer_ms(num_bytes) / 1e3
        self.at(link.free_at, self._transfer_done, d_inst, d_req)

    def _transfer_done(self, d_inst: Instance, d_req: SimRequest) -> None:
        transfer = self._transfers.pop(id(d_req))
        transfer.p_instance.release_blocks(transfer.p_request)
        self._kick(transfer.p_instance)
        d_req.state = State.WAITING
        d_req.loaded = True
        d_req.num_computed = d_req.spec.input_len - 1  # the minus-one rule
        self._kick(d_inst)


def simulate(cluster: ClusterSpec, profile: Profile, workload: Workload, options: SimOptions | None = None,
             pd_profile: Profile | None = None) -> SimResult:
    return ClusterSim(cluster, profile, workload, options, pd_profile).run()


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float
    percentile: float = 90.0

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError(f"SLOs must be > 0, got TTFT {self.ttft_s} s, TPOT {self.tpot_s} s")
        if not 0 < self.percentile <= 100:
            raise ValueError(f"the SLO percentile must be in (0, 100], got {self.percentile}")


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default, and bench_serving's)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    if ordered[high] == math.inf:
        return math.inf if pos > low or ordered[low] == math.inf else ordered[low]
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class Attainment:
    rate: float
    ttft_p_s: float
    tpot_p_s: float
    share_in_slo: float  # requests meeting both SLOs
    passed: bool
    extra: dict[str, float] = field(default_factory=dict)


def attainment(result: SimResult, slo: SLO, rate: float) -> Attainment:
    ttft = percentile(result.ttft_s, slo.percentile)
    tpot = percentile(result.tpot_s, slo.percentile)
    both = sum(1 for a, b in zip(result.ttft_s, result.tpot_s, strict=True)
               if a <= slo.ttft_s and b <= slo.tpot_s)
    return Attainment(rate, ttft, tpot, both / len(result.ttft_s), ttft <= slo.ttft_s and tpot <= slo.tpot_s)

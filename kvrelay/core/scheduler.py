"""The scheduler: one token budget per step, shared by running and waiting requests.

There is no prefill phase and no decode phase. Each step hands `max_num_batched_tokens` out to
running requests first (a decode takes one token, an unfinished prefill takes the next chunk),
then admits waiting requests while budget, sequence slots and KV blocks last. When blocks run
out, the most recently admitted running request is preempted (blocks freed, recomputed later).

The KV connector plugs in at admission (external tokens on top of the local prefix hit), at
the end of `schedule()` (per-step metadata for the worker side), when a request finishes
(delayed freeing) and in `update_from_output()` (finished and failed transfers).

Pure Python: this package never imports torch.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvrelay.core.kv_cache_manager import KVCacheManager
from kvrelay.core.kv_event_log import NULL_KV_EVENT_LOG, KVEventLog
from kvrelay.core.remote_kv import RemoteKVTracker
from kvrelay.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvrelay.core.stats import SchedulerStats
from kvrelay.kv_events.base import EventPublisher, NullEventPublisher
from kvrelay.kv_events.events import KVEventBatch
from kvrelay.kv_transfer.protocols import NULL_SCHEDULER_CONNECTOR
from kvrelay.outputs import EngineCoreOutput, KVConnectorOutput, ModelRunnerOutput
from kvrelay.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvrelay.config import EngineConfig
    from kvrelay.kv_transfer.protocols import SchedulerConnector

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int,
                 connector: SchedulerConnector | None = None,
                 kv_event_publisher: EventPublisher | None = None) -> None:
        self.config = config
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.long_prefill_token_threshold = config.scheduler.long_prefill_token_threshold
        self.max_model_len = max_model_len
        self.block_size = config.cache.block_size
        # KV events: the block pool logs its changes, one batch per step goes to the publisher.
        self.kv_event_publisher = kv_event_publisher or NullEventPublisher()
        self._publishes_events = kv_event_publisher is not None
        events = NULL_KV_EVENT_LOG if kv_event_publisher is None else KVEventLog(self.block_size)
        self.kv_cache_manager = KVCacheManager(
            num_blocks, self.block_size, enable_caching=config.cache.enable_prefix_caching, events=events)
        # The scheduler-side KV connector; a null one (every call does nothing) without KV transfer.
        self.connector: SchedulerConnector = NULL_SCHEDULER_CONNECTOR if connector is None else connector
        self.connector_name = type(connector).__name__ if connector is not None else ""
        kv_cfg = config.kv_transfer
        failure_policy = kv_cfg.kv_load_failure_policy if kv_cfg is not None else "recompute"
        self.remote = RemoteKVTracker(self.kv_cache_manager, self.block_size, failure_policy)
        self.stats = SchedulerStats()

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests the runner holds state for: [block ids sent, output tokens sent].
        self._runner_known: dict[str, list[int]] = {}
        # Ids the runner must forget at its next step.
        self._finished_req_ids: set[str] = set()
        # Finished requests whose blocks a connector still holds (delay_free), by id.
        self._held_by_connector: dict[str, Request] = {}
        # Outputs produced outside update_from_output (aborts, failed loads), flushed with the next one.
        self._pending_outputs: list[EngineCoreOutput] = []

    # ----------------------------------------------------------------------------- queries
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return sum(1 for r in self.waiting if r.status != RequestStatus.WAITING_FOR_REMOTE_KVS)

    @property
    def num_waiting_for_remote_kv(self) -> int:
        return sum(1 for r in self.waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_pending_work(self, include_held: bool = True) -> bool:
        """True while anything (requests, held blocks, connector transfers) needs more steps.
        With include_held=False, blocks a connector holds for another instance (a producer's
        blocks waiting for its consumer to read them) and the connector work they explain do
        not count: they settle on that other instance's schedule, not this caller's."""
        holding = bool(self._held_by_connector)
        connector_busy = not (holding and not include_held) and self.connector.has_pending_work()
        return bool(self.waiting or self.running or (holding and include_held)
                    or self.remote.has_pending() or self._pending_outputs or connector_busy)

    # ----------------------------------------------------------------------------- intake
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus,
                        stop_reason: int | str | None = None, report: bool = True) -> None:
        """Finish requests from outside the step (abort, stop string). Unknown ids are ignored.
        With report=False no output is produced (the caller already told the user)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for req_id in ids:
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            req.stop_reason = stop_reason
            params = self._free_request(req)
            if report:
                self._pending_outputs.append(self._make_output(req, [], [], params))

    def release_refused(self, request: Request) -> None:
        """A request refused before it was added (it cannot run here) is finished for the
        connector alone, which may owe a remote instance a release (D: the prompt's KV P holds)."""
        request.status = RequestStatus.FINISHED_ABORTED
        self.connector.request_finished(request, [])

    # ----------------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget, preempted = self._schedule_running(out, budget)
        if not preempted:
            self._schedule_waiting(out, budget)
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        out.finished_req_ids = self._finished_req_ids
        self._finished_req_ids = set()
        out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    @property
    def _max_chunk_tokens(self) -> int:
        """The most prompt tokens one request computes in one step."""
        if self.long_prefill_token_threshold > 0:
            return min(self.max_num_batched_tokens, self.long_prefill_token_threshold)
        return self.max_num_batched_tokens

    def _num_tokens_to_schedule(self, req: Request, budget: int) -> int:
        num_new = req.num_tokens - req.num_computed_tokens
        if self.long_prefill_token_threshold > 0:
            num_new = min(num_new, self.long_prefill_token_threshold)
        return min(num_new, budget)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, bool]:
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._num_tokens_to_schedule(req, budget)
            if num_new <= 0:
                i += 1
                continue
            while self.kv_cache_manager.allocate_slots(req, num_new, delay_cache_blocks=True) is None:
                victim = self.running.pop()  # the most recently admitted: lowest priority
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
            else:
                self._add_scheduled(out, req, num_new)
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: nothing after it can run either
        return budget, preempted

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        # The runner keeps the request's state (its sampling generator survives); the blocks go.
        self.kv_cache_manager.free(req)
        self._runner_known.pop(req.request_id, None)
        self._unschedule(out, req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        out_of_blocks = False
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                num_loaded = self.remote.try_promote(req)
                if num_loaded is None:
                    continue  # still loading: keep the queue position, let others pass
                self.stats.add_external(self.connector_name, num_loaded)
            # NOTE: once a request is out of blocks, later ones must not overtake it, except a
            # request admitted earlier whose load has settled: it runs on blocks it holds or
            # had set aside, which the blocked request could not have had anyway.
            if out_of_blocks and not self.kv_cache_manager.get_block_ids(req.request_id):
                continue
            admitted = self._admit(req, out, budget)
            if admitted is None:
                out_of_blocks = True
                continue
            budget -= admitted

    def _admit(self, req: Request, out: SchedulerOutput, budget: int) -> int | None:
        """Try to admit one waiting request. Returns the tokens it takes from the budget, or
        None when its blocks cannot be allocated now (nothing changed then)."""
        kv = self.kv_cache_manager
        computed_blocks: list[Any] = []
        num_local = num_external = 0
        load_async = False
        # A request that already holds blocks (its remote load settled) skips the lookups.
        looked_up = not kv.get_block_ids(req.request_id)
        if looked_up:
            computed_blocks, num_local = kv.get_computed_blocks(req)
            num_external, load_async = self.connector.get_num_new_matched_tokens(req, num_local)
            if not load_async:  # a synchronous load must leave the last token to compute
                num_external = max(0, min(num_external, req.num_tokens - 1 - num_local))
        num_computed = req.num_computed_tokens + num_local + num_external
        num_new = reserve_tokens = 0
        if load_async:
            # The load may settle short of what was asked: set aside what the request's first
            # step afterwards can need, so it can always run then (no two loads wedge the pool).
            reserve_tokens = min(req.num_tokens, num_computed + self._max_chunk_tokens)
        else:
            num_new = min(req.num_tokens - num_computed, budget)
            if self.long_prefill_token_threshold > 0:
                num_new = min(num_new, self.long_prefill_token_threshold)
        new_blocks = kv.allocate_slots(
            req, num_new, num_new_computed_tokens=num_local, new_computed_blocks=computed_blocks,
            delay_cache_blocks=True, num_external_computed_tokens=num_external,
            reserve_tokens=reserve_tokens)
        if new_blocks is None:
            return None
        # NOTE: only after a lookup: a request promoted after a failed load must not look to
        # the connector like a new admission (it could start a second transfer).
        if looked_up:
            self.connector.update_state_after_alloc(req, kv.get_block_ids(req.request_id), num_external)
        if req.num_local_cached_tokens < 0:  # the first admission
            req.num_local_cached_tokens, req.num_external_cached_tokens = num_local, num_external
            self.stats.prompt_tokens_cached += num_local
        if load_async:
            self.remote.start_waiting(req, num_local, num_external)
            return 0
        kv.release_reservation(req.request_id)
        self.waiting.remove(req)
        req.num_computed_tokens = num_computed
        req.num_external_tokens += num_external
        req.num_external_unconfirmed = num_external
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._add_scheduled(out, req, num_new)
        return num_new

    def _add_scheduled(self, out: SchedulerOutput, req: Request, num_new: int) -> None:
        req_id = req.request_id
        block_ids = self.kv_cache_manager.get_block_ids(req_id)
        known = self._runner_known.get(req_id)
        if known is None:
            out.scheduled_new_reqs.append(NewRequestData(
                req_id=req_id, prompt_token_ids=req.prompt_token_ids,
                output_token_ids=list(req.output_token_ids), sampling_params=req.sampling_params,
                block_ids=list(block_ids), num_computed_tokens=req.num_computed_tokens))
        else:
            out.scheduled_cached_reqs.append(CachedRequestData(
                req_id=req_id, new_block_ids=list(block_ids[known[0]:]),
                num_computed_tokens=req.num_computed_tokens,
                new_token_ids=list(req.output_token_ids[known[1]:])))
        self._runner_known[req_id] = [len(block_ids), req.num_output_tokens]
        out.num_scheduled_tokens[req_id] = num_new

    def _unschedule(self, out: SchedulerOutput, req: Request) -> None:
        req_id = req.request_id
        if out.num_scheduled_tokens.pop(req_id, None) is None:
            return
        out.scheduled_new_reqs = [r for r in out.scheduled_new_reqs if r.req_id != req_id]
        out.scheduled_cached_reqs = [r for r in out.scheduled_cached_reqs if r.req_id != req_id]

    # ----------------------------------------------------------------------------- update
    def update_from_output(self, sched_out: SchedulerOutput,
                           runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        kv_out = runner_out.kv_connector_output or KVConnectorOutput()
        # Failed loads first: a request computed on top of bad KV must not keep its token.
        discard = self._handle_failed_loads(kv_out, outputs)
        sampled = dict(zip(runner_out.req_ids, runner_out.sampled_token_ids, strict=True))
        logprobs = dict(zip(runner_out.req_ids, runner_out.logprobs or [], strict=False))
        for req_id, num_scheduled in sched_out.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING or req_id in discard:
                continue
            self._count_computed(req, num_scheduled)
            if req.num_external_unconfirmed:
                self.stats.add_external(self.connector_name, req.num_external_unconfirmed)
                req.num_external_unconfirmed = 0
            req.num_computed_tokens += num_scheduled
            self.kv_cache_manager.cache_blocks(req, min(req.num_computed_tokens, req.num_tokens))
            new_ids = sampled.get(req_id) or []
            if new_ids:
                self._append_and_check_stop(req, new_ids)
            lp = logprobs.get(req_id)
            if new_ids or req.is_finished:
                params = self._finish_if_done(req)
                outputs.append(self._make_output(req, new_ids, [lp] if lp else [], params))
        self._handle_transfers(kv_out, outputs)
        self.publish_kv_events()
        return outputs

    def publish_kv_events(self) -> None:
        """Hand this step's KV events (stores, evictions, clears: of the KV cache, and of the
        connector's tiers) to the publisher as one batch."""
        if not self._publishes_events:
            return
        events = self.kv_cache_manager.take_events() + self.connector.take_events()
        if events:
            self.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def _count_computed(self, req: Request, num_scheduled: int) -> None:
        prompt_left = max(0, req.num_prompt_tokens - req.num_computed_tokens)
        self.stats.prompt_tokens_computed += min(prompt_left, num_scheduled)

    def _append_and_check_stop(self, req: Request, new_ids: list[int]) -> None:
        params = req.sampling_params
        for token in new_ids:
            req.append_output_token_ids(token)
            self.stats.generation_tokens += 1
            min_ok = req.num_output_tokens >= params.min_tokens
            if min_ok and not params.ignore_eos and token in req.eos_token_ids:
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None
            elif min_ok and token in (params.stop_token_ids or ()):
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
            elif (req.num_output_tokens >= (params.max_tokens or self.max_model_len)
                  or req.num_tokens >= self.max_model_len):
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            if req.is_finished:
                return

    def _finish_if_done(self, req: Request) -> dict[str, Any] | None:
        if not req.is_finished:
            return None
        self.running.remove(req)
        return self._free_request(req)

    def _free_request(self, req: Request) -> dict[str, Any] | None:
        """Release a finished request: the connector may keep its blocks (delay_free), and an
        in-flight load keeps them until it settles. Returns the connector's kv_transfer_params."""
        req_id = req.request_id
        delay_free, params = self.connector.request_finished(req, self.kv_cache_manager.get_block_ids(req_id))
        if params is not None and params.get("do_remote_prefill"):
            # NOTE: vLLM's field: D reports P's cache hit in its usage, not the KV it loaded.
            params = {**params, "remote_prefill_cached_tokens": req.num_cached_tokens}
        if req_id in self._runner_known or req.num_preemptions:
            self._finished_req_ids.add(req_id)
        self._runner_known.pop(req_id, None)
        if delay_free:
            req.blocks_held_by_connector = True
            self._held_by_connector[req_id] = req
        self._release_when_settled(req)
        return params

    def _release_when_settled(self, req: Request) -> None:
        """Free a finished request's blocks, unless the connector still holds them or a load
        into them is in flight; whichever settles last calls this again."""
        # NOTE: the tracker is asked first, so it also keeps a held request whose load is in
        # flight: the load may outlive the connector's hold.
        if self.remote.defer_free_if_loading(req) or req.blocks_held_by_connector:
            return
        self._release(req)

    def _release(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        self.requests.pop(req.request_id, None)

    def _handle_failed_loads(self, kv_out: KVConnectorOutput,
                             outputs: list[EngineCoreOutput]) -> set[str]:
        """Apply the failure policy to requests whose loaded KV is missing or invalid. Returns
        the ids whose results from this step must be discarded."""
        kv = self.kv_cache_manager
        # NOTE: whatever the policy and whenever it is reported, a block found invalid (and
        # anything computed on top of it) leaves the prefix cache before anyone can hit it.
        kv.uncache_block_ids(kv_out.invalid_block_ids)
        discard: set[str] = set()
        for req, num_valid, ok in self.remote.apply_failures(kv_out, self.running, self.waiting):
            self.stats.kv_load_failures += 1
            kv.unpublish_from(req, num_valid)
            if ok:  # recompute: the tracker already rolled num_computed_tokens back
                discard.add(req.request_id)
                if req.status == RequestStatus.RUNNING:
                    # Drop (and unpublish) the blocks past the valid prefix; the runner gets the
                    # request afresh next step with its new block list.
                    kv.truncate(req, req.num_computed_tokens)
                    self._runner_known.pop(req.request_id, None)
                continue
            req.status = RequestStatus.FINISHED_ERROR
            req.error = "loading the request's KV cache failed (kv_load_failure_policy=fail)"
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            discard.add(req.request_id)
            params = self._free_request(req)
            outputs.append(self._make_output(req, [], [], params))
        return discard

    def _handle_transfers(self, kv_out: KVConnectorOutput, outputs: list[EngineCoreOutput]) -> None:
        for req_id in kv_out.finished_recving:
            settled = self.remote.on_finished_recving(req_id)
            if settled is not None:  # finished (aborted) while its load was in flight
                self._release_when_settled(settled)
        for req_id in kv_out.failed_recving:
            settled = self.remote.on_failed_recving_settled(req_id)
            if settled is not None:
                self._release_when_settled(settled)
        for req_id in kv_out.finished_sending:
            req = self._held_by_connector.pop(req_id, None)
            if req is not None:
                req.blocks_held_by_connector = False
                self._release_when_settled(req)
        self.connector.update_connector_output(kv_out)
        self.stats.absorb_connector_stats(kv_out.stats)

    def _make_output(self, req: Request, new_ids: list[int], logprobs: list[Any],
                     params: dict[str, Any] | None) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=req.request_id, new_token_ids=list(new_ids), new_logprobs=logprobs,
            finish_reason=req.status.finish_reason, stop_reason=req.stop_reason,
            kv_transfer_params=params, num_cached_tokens=req.num_cached_tokens,
            error=req.error)

    # ----------------------------------------------------------------------------- misc
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix (vLLM's semantics): refused (False) while a block is held,
        unless `reset_running_requests` preempts the running requests first (they recompute).
        Blocks held for a transfer still refuse it."""
        if reset_running_requests:
            discarded = SchedulerOutput()  # between steps: nothing is scheduled
            while self.running:  # the latest first, so the waiting queue keeps their order
                self._preempt(self.running.pop(), discarded)
        reset = self.kv_cache_manager.reset_prefix_cache()
        self.publish_kv_events()  # now: no step may follow soon
        return reset

    @property
    def blocks_in_use(self) -> int:
        return self.kv_cache_manager.blocks_in_use

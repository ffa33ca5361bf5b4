"""P's pushes: registrations from decode instances, and the writes into their blocks.

A push request on P is a `_Job` from its first computing step until its blocks are freed; a
decode instance registers for it over the side channel (`register`, on the server thread), as a
rule before P computes it. The engine thread then writes:

    save_kv_layer(layer)   that layer's blocks for the tokens computed so far, while the forward
                           pass goes on with the next layers (and, with chunked prefill, beside
                           the next chunks); a partial last block is written again with the
                           next chunk
    late registration      everything computed so far at once, then layer by layer
    completing write       once every earlier write of the job is done, the last one carries
                           the notification (P's checksums of the pushed blocks; each
                           layer's share was folded in by save_kv_layer as its blocks became
                           final, so only the last layer's share is left on the critical path)

Over a one-sided transport (NIXL, Mooncake) every earlier write carries a small `PushLanded`
(its layers and prompt blocks), delivered once the bytes landed: D sums each write as it lands.

Between tensor-parallel instances (push/sender_state.py) a job has one registration per D rank
that reads from this P rank, each written its own byte ranges of every block (whole blocks
between equal sizes) and each checksummed over exactly those bytes; a D rank that will not
register declines instead (`cancel` of a registration P never saw).

NOTE: the safety of D's blocks. P starts no write for a registration that was cancelled or
whose lease ran out (D renews it with heartbeats), and says "cancelled" only when none of its
writes is in flight; every check and every write start happen under one lock. So once D heard
"cancelled", or its last renewal plus the lease and a write's time bound have passed, nothing
of P's lands in those blocks any more. The bounds D counts on are D's: P takes no registration
or heartbeat older than D's timeout and grants no longer lease than D states, even when its
own settings are longer.

P frees a finished request's blocks (finished_sending) when no write is in flight and every
reader's push ended (completed, failed, cancelled, declined) or the lease expired first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvrelay.kv_transfer.p2p import security
from kvrelay.kv_transfer.p2p.tp_plan import plan_writes
from kvrelay.kv_transfer.push.meta import (
    PUSH_CANCELLED,
    PUSH_CANCELLING,
    PUSH_FAILED,
    PUSH_REFUSED,
    PUSH_WAITING,
    PUSH_WRITING,
    PUSH_WRITTEN,
    NixlPushMetadata,
    PushCancel,
    PushLanded,
    PushNotification,
    PushRef,
    PushRegister,
    PushStatus,
)
from kvrelay.kv_transfer.push.sender_state import (
    LEASE_EXPIRED,
    Job,
    Readers,
    Registration,
    blocks_problem,
    prompt_mismatch,
    reader_plan,
    write_ranges,
)
from kvrelay.kv_transfer.transport.base import RegionLayout, TransferHandle, TransferState
from kvrelay.model.sharding import kv_heads_of_rank
from kvrelay.utils import cdiv

if TYPE_CHECKING:
    import torch

    from kvrelay.kv_transfer.base import KVCacheSpec
    from kvrelay.kv_transfer.p2p.settings import PushConfig
    from kvrelay.kv_transfer.transport.base import KVTransport

logger = logging.getLogger(__name__)

_MAX_WAITING = 1024  # requests with registrations P has not started yet
_MAX_REMEMBERED = 4096  # ended jobs (and early declines) remembered


class PushSender:
    def __init__(self, transport: KVTransport, kv_spec: KVCacheSpec, layout: RegionLayout, config: PushConfig,
                 kv_layers: Sequence[torch.Tensor], num_kv_heads: int | None = None) -> None:
        self.transport = transport
        self.kv_spec = kv_spec
        self.layout = layout
        self.config = config
        self.kv_layers = list(kv_layers)
        self.num_layers = len(layout.layer_names)
        self.block_size = kv_spec.block_size
        # NOTE: the model's KV heads (kv_spec's are this rank's share), as the fingerprint names them
        model_heads = kv_spec.fingerprint.get("num_kv_heads", kv_spec.num_kv_heads * kv_spec.tp_size)
        self.num_kv_heads = num_kv_heads or int(model_heads)
        num_local_heads = len(kv_heads_of_rank(self.num_kv_heads, kv_spec.tp_size, kv_spec.tp_rank))
        self.head_bytes = layout.block_bytes // (2 * num_local_heads)
        self.reg_lease_s = min(config.lease_seconds, 3 * config.heartbeat_seconds)
        self._lock = threading.RLock()
        self._jobs: dict[str, Job] = {}
        self._waiting: OrderedDict[str, Readers] = OrderedDict()  # by transfer id: no job yet
        self._to_connect: list[Registration] = []
        self._ended: OrderedDict[str, tuple[str, str]] = OrderedDict()  # transfer id -> (state, why)
        self._active: list[Job] = []  # jobs this step computes
        self._write_bytes: dict[int, int] = {}  # id(handle) -> bytes, until it settles
        self._stats: dict[str, float] = {}

    def has_pending(self) -> bool:
        return bool(self._jobs) or any(r.registrations for r in self._waiting.values())

    def writes_this_step(self) -> bool:  # a prompt it pushes is computed: writes go out per layer
        return bool(self._active)

    # ---------------------------------------------------------------- engine thread: steps

    def begin_step(self, meta: NixlPushMetadata) -> None:
        with self._lock:
            for step in meta.steps:
                job = self._job_for(step.transfer_id, step.req_id, step.num_prompt_tokens, step.prompt_digest)
                moved = job.block_ids != step.block_ids[:len(job.block_ids)]
                if step.num_computed_before < job.ready or moved:
                    for reg in job.registrations:  # preempted and recomputed: send it all again
                        reg.reset()
                job.block_ids = list(step.block_ids)
                job.ready, job.step_end, job.started = step.num_computed_before, step.num_computed_after, True
                self._active.append(job)
            for hold in meta.holds:
                job = self._job_for(hold.transfer_id, hold.req_id, 0, b"")
                job.finished, job.complete = True, hold.complete
                job.hold_expires = time.monotonic() + hold.lease_seconds
                if not hold.complete:
                    for reg in job.registrations:
                        reg.failure = reg.failure or "the prefill instance aborted the request"
        self._connect_and_catch_up()

    def save_layer(self, layer: int) -> None:
        for job in self._active:
            job.layers_computed += 1
            if job.step_end is not None:
                for reg in job.registrations:
                    if reg.ended:
                        continue
                    self._fold(job, reg, layer, job.step_end)
                    if self.config.layerwise:
                        self._push(job, reg, [layer], job.step_end)

    def _fold(self, job: Job, reg: Registration, layer: int, upto: int) -> None:
        """Fold `layer`'s blocks that are final at `upto` tokens into the registration's checksums,
        so the completing write has only the last layer's share left to add."""
        num_prompt_blocks = cdiv(job.num_prompt_tokens, self.block_size)
        if reg.digests is None:
            reg.digests = security.DigestFold(self.kv_layers, num_prompt_blocks, reg.local_ranges)
        # NOTE: a partial last block changes until the prompt is complete; fold it only then
        final = num_prompt_blocks if upto >= job.num_prompt_tokens else upto // self.block_size
        reg.digests.fold(layer, job.block_ids, final)

    def end_step(self) -> None:
        """wait_for_save: a step's writes finish before the next step may rewrite the pages.

        NOTE: the bound on the lag is one step. A chunk's partial last block is written again
        with the next chunk; waiting here keeps the older write from landing after the newer."""
        for job in self._active:
            if job.step_end is not None:
                if job.step_end < job.num_prompt_tokens and job.writing:
                    for reg in job.registrations:
                        self._settle_writes(job, reg)
                job.ready, job.step_end = job.step_end, None
                if not self.config.layerwise and job.ready >= job.num_prompt_tokens:
                    for reg in job.registrations:
                        self._catch_up(job, reg)  # after prefill: the whole prompt in one write
        self._active = []

    def _job_for(self, transfer_id: str, req_id: str, num_prompt_tokens: int, digest: bytes) -> Job:
        job = self._jobs.get(transfer_id)
        if job is None:
            job = Job(transfer_id, req_id, num_prompt_tokens, digest, [])
            early = self._waiting.pop(transfer_id, None)
            if early is not None:
                job.readers = early
                for reg in early.registrations.values():
                    problem = prompt_mismatch(job, reg.request) if num_prompt_tokens else None
                    if problem is not None:
                        reg.refused, reg.failure = True, problem
            self._jobs[transfer_id] = job
        return job

    # ---------------------------------------------------------------- engine thread: writes

    def _connect_and_catch_up(self) -> None:
        with self._lock:
            pending, self._to_connect = self._to_connect, []
        for reg in pending:
            try:
                req = reg.request
                layout = RegionLayout(tuple(req.layer_names), req.num_blocks, req.block_bytes,
                                      tuple(req.base_addresses), req.device)
                self.transport.add_remote(reg.remote_name, req.agent_metadata, layout)
                reg.connected = True
            except Exception as e:
                reg.failure = f"cannot reach the decode instance's {self.config.backend} transport: {e}"
        for job in list(self._jobs.values()):
            done = self.config.layerwise or job.ready >= job.num_prompt_tokens
            if job.step_end is None and done:
                for reg in job.registrations:
                    if self._writable(reg):
                        self._catch_up(job, reg)

    def _catch_up(self, job: Job, reg: Registration) -> None:
        """Write every layer up to what is computed (a late registration; or a step's end)."""
        if len(set(reg.sent)) == 1:
            self._push(job, reg, list(range(self.num_layers)), job.ready)
            return
        for layer in range(self.num_layers):
            self._push(job, reg, [layer], job.ready)

    @staticmethod
    def _writable(reg: Registration | None) -> bool:
        return (reg is not None and reg.connected and not reg.cancelled and not reg.failure
                and reg.final is None and time.monotonic() < reg.expires)

    def _push(self, job: Job, reg: Registration, layers: list[int], upto: int) -> None:
        """Write `layers`' blocks (or their byte ranges) for tokens [sent, upto) into the
        registration's blocks."""
        if not self._writable(reg) or upto <= 0:
            return
        req = reg.request
        num_prompt_blocks = cdiv(job.num_prompt_tokens, self.block_size)
        sent = reg.sent[layers[0]]
        start, end = max(req.first_block, sent // self.block_size), min(cdiv(upto, self.block_size),
                                                                         num_prompt_blocks)
        others_done = all(reg.sent[i] >= job.num_prompt_tokens
                          for i in range(self.num_layers) if i not in layers)
        final = upto >= job.num_prompt_tokens and others_done
        new_sent = upto if upto >= job.num_prompt_tokens else upto // self.block_size * self.block_size
        if end <= start and not final:  # nothing D lacks in this range (its local hit covers it)
            for layer in layers:
                reg.sent[layer] = max(reg.sent[layer], new_sent)
            return
        # NOTE: a one-sided write lands unseen by D: its notification tells D what landed, so D
        # sums those blocks then rather than every block of every layer at the end
        landed = (PushLanded(job.transfer_id, req.registration_id, list(layers), start, end)
                  if end > start and not self.transport.sees_writes else None)
        notification = landed.encode() if landed is not None else b""
        if final:
            if not self._settle_writes(job, reg):
                return
            if reg.digests is None:
                reg.digests = security.DigestFold(self.kv_layers, num_prompt_blocks, reg.local_ranges)
            checksums = reg.digests.digests(job.block_ids, req.first_block)
            notification = PushNotification(job.transfer_id, req.registration_id, checksums,
                                            landed, reg.num_landed).encode()
        local = job.block_ids[start:end] if end > start else []
        remote = req.block_ids[start - req.first_block:end - req.first_block] if end > start else []
        with self._lock:  # NOTE: checked and started under the lock that a cancel takes
            if not self._writable(reg):
                return
            try:
                handle = self.transport.write_blocks(reg.remote_name, local, remote, notification, layers,
                                                     ranges=reg.ranges)
            except Exception as e:
                reg.failure = f"the transport refused the write: {e}"
                return
            reg.writes.append(handle)
            if landed is not None and not final:
                reg.num_landed += 1
            per_block = self.layout.block_bytes if reg.ranges is None else sum(r.length for r in reg.ranges)
            self._write_bytes[id(handle)] = len(local) * len(layers) * per_block
            if final:
                reg.final = handle
        for layer in layers:
            reg.sent[layer] = max(reg.sent[layer], new_sent)

    def _settle_writes(self, job: Job, reg: Registration) -> bool:
        """Wait (bounded) until the registration's earlier writes are done: the completing write
        must not overtake them. False when one failed or they took too long (the push fails)."""
        deadline = time.monotonic() + self.config.transfer_timeout_seconds
        while True:
            self._prune(job)
            if reg.failure:
                return False
            if not reg.writes:
                return True
            if time.monotonic() > deadline:
                reg.failure = f"writes did not finish within {self.config.transfer_timeout_seconds:.1f} s"
                return False
            time.sleep(0.0002)

    def _prune(self, job: Job) -> None:
        """Drop the job's finished writes; a failed one fails its registration."""
        with self._lock:
            for reg in job.registrations:
                still: list[TransferHandle] = []
                for handle in reg.writes:
                    state = handle.poll()
                    if state == TransferState.PENDING:
                        still.append(handle)
                        continue
                    num_bytes = self._write_bytes.pop(id(handle), 0)
                    if state == TransferState.DONE:  # NOTE: counted once landed, not when started
                        self._count("bytes_saved", num_bytes)
                    if state == TransferState.ERROR and not reg.failure:
                        reg.failure = f"a write failed: {handle.error}"
                        self._count("save_failures")
                    if handle is reg.final and state == TransferState.DONE:
                        reg.final_done = True
                    handle.release()
                reg.writes = still

    # ---------------------------------------------------------------- engine thread: every step

    def poll(self) -> tuple[set[str], dict[str, float]]:
        """Requests whose blocks may be freed now, and this step's statistics."""
        self._connect_and_catch_up()
        ended: set[str] = set()
        now = time.monotonic()
        with self._lock:
            for transfer_id, readers in list(self._waiting.items()):
                if now >= readers.match_by:  # its request never started here
                    del self._waiting[transfer_id]
                    self._remember(transfer_id, PUSH_REFUSED, "no request with this transfer id started here")
        for job in list(self._jobs.values()):
            self._prune(job)
            reason = job.end_reason(now)
            if reason is not None and not job.writing:
                if reason == LEASE_EXPIRED:
                    self._count("lease_expired")
                    logger.info("NixlPushConnector: not every decode rank registered for %s; freeing its "
                                "blocks", job.transfer_id)
                with self._lock:
                    del self._jobs[job.transfer_id]
                    self._remember(job.transfer_id, *reason)
                if job.finished:
                    ended.add(job.req_id)
        stats, self._stats = self._stats, {}
        return ended, stats

    def _count(self, key: str, value: float = 1) -> None:
        self._stats[key] = self._stats.get(key, 0) + value

    def _remember(self, transfer_id: str, state: str, why: str) -> None:
        self._ended[transfer_id] = (state, why)
        while len(self._ended) > _MAX_REMEMBERED:
            self._ended.popitem(last=False)

    # ---------------------------------------------------------------- side channel (server thread)

    def register(self, request: PushRegister, identity_problem: str | None) -> PushStatus:
        def refuse(why: str, state: str = PUSH_REFUSED) -> PushStatus:
            return PushStatus(transfer_id=request.transfer_id, state=state, error=why)

        if identity_problem is not None:
            return refuse(identity_problem)
        age = time.time() - request.sent_at
        if age > self._max_age(request.max_age_s):  # NOTE: D stopped waiting for it already
            return refuse(f"the registration arrived {age:.1f} s after it was sent")
        read, problem = reader_plan(request, self.num_kv_heads, self.kv_spec.tp_size, self.kv_spec.tp_rank,
                                    self.head_bytes, self.layout.block_bytes)
        problem = problem or blocks_problem(request, self.block_size)
        if problem is not None:
            return refuse(problem)
        assert read is not None
        now = time.monotonic()
        with self._lock:
            ended = self._ended.get(request.transfer_id)
            if ended is not None:
                return refuse(f"the request already ended here: {ended[1] or ended[0]}")
            job = self._jobs.get(request.transfer_id)
            started = job is not None and job.started
            if job is not None and started:
                problem = prompt_mismatch(job, request)
                if problem is None and job.finished and not job.complete:
                    problem = "the prefill instance aborted the request"
            elif request.transfer_id not in self._waiting and sum(
                    1 for r in self._waiting.values() if r.registrations) >= _MAX_WAITING:
                problem = f"registrations for {_MAX_WAITING} requests already wait for them to start"
            readers = job.readers if job is not None and started else self._waiting.get(request.transfer_id)
            readers = readers if readers is not None else Readers()
            problem = problem or readers.fix_tp(request.tp_size, self._expected(request.tp_size))
            if problem is None and request.tp_rank in set(readers.registrations) | readers.declined:
                problem = f"decode rank {request.tp_rank} already registered (or declined) for this request"
            if problem is not None:
                return refuse(problem)
            if not started:
                self._keep_early(request.transfer_id, readers)
            lease_s = min(self.reg_lease_s, request.max_lease_s or self.reg_lease_s)
            reg = Registration(request, f"{request.engine_id}/{request.instance_id}", lease_s,
                               expires=now + lease_s, match_by=now + self.config.transfer_timeout_seconds,
                               num_layers=self.num_layers, ranges=write_ranges(read))
            readers.registrations[request.tp_rank] = reg
            self._to_connect.append(reg)
            return self._status(request.transfer_id, reg, now)

    def _keep_early(self, transfer_id: str, readers: Readers) -> None:
        """Keep what D ranks said about a request that has not started here."""
        self._waiting[transfer_id] = readers
        while len(self._waiting) > _MAX_REMEMBERED:
            self._waiting.popitem(last=False)

    def _expected(self, d_tp: int) -> frozenset[int]:
        return frozenset(plan_writes(self.num_kv_heads, self.kv_spec.tp_size, d_tp, self.kv_spec.tp_rank,
                                     self.head_bytes))

    def _max_age(self, stated: float) -> float:
        """How old a registration or heartbeat may be: ours and D's transfer timeout, the shorter."""
        own = self.config.transfer_timeout_seconds
        return min(own, stated) if stated > 0 else own

    def heartbeat(self, refs: Sequence[PushRef], sent_at: float, max_age_s: float = 0.0) -> list[PushStatus]:
        now = time.monotonic()
        # NOTE: a heartbeat that took longer than D's timeout renews nothing: D may have given up.
        fresh = time.time() - sent_at <= self._max_age(max_age_s)
        with self._lock:
            statuses = []
            for ref in refs:
                reg = self._find(ref.transfer_id, ref.registration_id)
                if reg is not None and fresh:
                    reg.expires = max(reg.expires, now + reg.lease_s)
                statuses.append(self._status(ref.transfer_id, reg, now))
            return statuses

    def cancel(self, request: PushCancel) -> PushStatus:
        """D gives up (or aborted): no new write starts; "cancelled" once none is in flight. For
        a registration never taken: that D rank will not register (nobody, without a tp_size)."""
        transfer_id = request.transfer_id
        with self._lock:
            reg = self._find(transfer_id, request.registration_id)
            if reg is None:
                return self._decline(request)
            reg.cancelled = True
            job = self._jobs.get(transfer_id)
            if job is None or not job.started:
                # NOTE: kept (cancelled) until its request arrives, so P frees that request's
                # blocks as soon as it finishes rather than holding them for the lease.
                return PushStatus(transfer_id=transfer_id, state=PUSH_CANCELLED)
            busy = bool(reg.writes)
            return PushStatus(transfer_id=transfer_id, state=PUSH_CANCELLING if busy else PUSH_CANCELLED)

    def _decline(self, request: PushCancel) -> PushStatus:
        job = self._jobs.get(request.transfer_id)
        readers = job.readers if job is not None else self._waiting.get(request.transfer_id, Readers())
        if request.tp_size <= 0:
            readers.declined_all = True
        else:
            try:
                problem = readers.fix_tp(request.tp_size, self._expected(request.tp_size))
            except ValueError as e:
                problem = str(e)
            if problem is not None:
                return PushStatus(transfer_id=request.transfer_id, state=PUSH_REFUSED, error=problem)
            readers.declined.add(request.tp_rank)
        if job is None:
            self._keep_early(request.transfer_id, readers)
        return PushStatus(transfer_id=request.transfer_id, state=PUSH_CANCELLED)

    def _find(self, transfer_id: str, registration_id: str) -> Registration | None:
        job = self._jobs.get(transfer_id)
        for readers in (job.readers if job is not None else None, self._waiting.get(transfer_id)):
            reg = readers.find(registration_id) if readers is not None else None
            if reg is not None:
                return reg
        return None

    def _status(self, transfer_id: str, reg: Registration | None, now: float) -> PushStatus:
        job = self._jobs.get(transfer_id)
        if reg is None:
            state, why = self._ended.get(transfer_id, (PUSH_REFUSED, "no such registration here"))
            return PushStatus(transfer_id=transfer_id, state=state, error=why)
        if reg.refused:
            return PushStatus(transfer_id=transfer_id, state=PUSH_REFUSED, error=reg.failure)
        if reg.failure or reg.cancelled:
            return PushStatus(transfer_id=transfer_id, state=PUSH_FAILED, error=reg.failure or "cancelled")
        if job is None or not job.started:
            if now >= reg.match_by:
                readers = self._waiting.get(transfer_id)
                if readers is not None and readers.find(reg.request.registration_id) is reg:
                    del self._waiting[transfer_id]
                reg.failure = "no request with this transfer id started here in time"
                self._remember(transfer_id, PUSH_REFUSED, reg.failure)
                return PushStatus(transfer_id=transfer_id, state=PUSH_REFUSED, error=reg.failure)
            return PushStatus(transfer_id=transfer_id, state=PUSH_WAITING, lease_s=reg.lease_s)
        state = PUSH_WRITTEN if reg.final is not None else PUSH_WRITING
        computed = job.step_end if job.step_end is not None else job.ready
        return PushStatus(transfer_id=transfer_id, state=state, num_computed=computed,
                          layers_computed=job.layers_computed, lease_s=reg.lease_s)

    def release_all(self) -> set[str]:
        """Shutdown: every held request ends now."""
        with self._lock:
            ended = {job.req_id for job in self._jobs.values() if job.finished}
            self._jobs.clear()
            self._waiting.clear()
        return ended

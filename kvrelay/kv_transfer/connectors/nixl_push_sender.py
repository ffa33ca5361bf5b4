"""P's pushes: registrations from decode instances, and the writes into their blocks.

A push request on P is a `_Job` from its first computing step until its blocks are freed. A
decode instance registers for it over the side channel (`register`, on the server thread),
before P computes it (the normal case: the proxy starts both legs at once) or after. The engine
thread then writes:

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
(its layers and prompt-block range), which the transport delivers once the bytes landed, so D
sums each write's blocks as it lands, as it does over TCP where it sees the writes itself.

NOTE: the safety of D's blocks. P starts no write for a registration that was cancelled or
whose lease ran out (D renews it with heartbeats), and says "cancelled" only when none of its
writes is in flight; every check and every write start happen under one lock. So once D heard
"cancelled", or its last renewal plus the lease and a write's time bound have passed, nothing
of P's lands in those blocks any more. The bounds D counts on are D's: P takes no registration
or heartbeat older than D's timeout and grants no longer lease than D states, even when its
own settings are longer.

P frees the blocks of a finished request (finished_sending) when no write is in flight and the
push completed, failed, was cancelled, or nobody registered before the lease expired.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvrelay.kv_transfer.connectors import security
from kvrelay.kv_transfer.connectors.nixl_push_meta import (
    PUSH_CANCELLED,
    PUSH_CANCELLING,
    PUSH_FAILED,
    PUSH_REFUSED,
    PUSH_WAITING,
    PUSH_WRITING,
    PUSH_WRITTEN,
    NixlPushMetadata,
    PushLanded,
    PushNotification,
    PushRef,
    PushRegister,
    PushStatus,
)
from kvrelay.kv_transfer.transport.base import RegionLayout, TransferHandle, TransferState

if TYPE_CHECKING:
    import torch

    from kvrelay.kv_transfer.base import KVCacheSpec
    from kvrelay.kv_transfer.connectors.nixl_push import PushConfig
    from kvrelay.kv_transfer.transport.base import KVTransport

logger = logging.getLogger(__name__)

_MAX_WAITING = 1024  # registrations held for requests P has not started yet
_MAX_REMEMBERED = 4096  # ended jobs remembered, to refuse registrations for them


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Registration:
    request: PushRegister
    remote_name: str  # the transport's name for D: engine id and instance, so a restart is new
    lease_s: float
    expires: float  # monotonic: P starts no write for it after this
    match_by: float  # monotonic: refused unless its request started here by then
    connected: bool = False  # D's agent added to the transport (engine thread)
    cancelled: bool = False
    failure: str = ""
    final: TransferHandle | None = None  # the completing write
    final_done: bool = False
    num_landed: int = 0  # earlier writes that went out with a PushLanded (one-sided transports)

    @property
    def ref(self) -> PushRef:
        return PushRef(self.request.transfer_id, self.request.registration_id)


@dataclass
class _Job:
    transfer_id: str
    req_id: str
    num_prompt_tokens: int
    prompt_digest: bytes
    block_ids: list[int]
    sent: list[int]  # per layer: prompt tokens whose KV D holds (or is being written)
    ready: int = 0  # tokens whose KV exists in every layer
    step_end: int | None = None  # this step's forward computes up to here, layer by layer
    layers_computed: int = 0  # progress D sees: advances with every layer of every chunk
    writes: list[TransferHandle] = field(default_factory=list)
    registration: _Registration | None = None
    started: bool = False  # a step computed it (False: known from a hold only)
    declined: bool = False  # D gave up before it registered: nobody will
    finished: bool = False
    complete: bool = False
    hold_expires: float = float("inf")
    digests: security.DigestFold | None = None  # P's checksums, folded in as blocks become final


class PushSender:
    def __init__(self, transport: KVTransport, kv_spec: KVCacheSpec, layout: RegionLayout,
                 config: PushConfig, kv_layers: Sequence[torch.Tensor]) -> None:
        self.transport = transport
        self.kv_spec = kv_spec
        self.layout = layout
        self.config = config
        self.kv_layers = list(kv_layers)
        self.num_layers = len(self.kv_layers)
        self.block_size = kv_spec.block_size
        self.reg_lease_s = min(config.lease_seconds, 3 * config.heartbeat_seconds)
        self._lock = threading.RLock()
        self._jobs: dict[str, _Job] = {}
        self._waiting: dict[str, _Registration] = {}  # by transfer id: no job yet
        self._to_connect: list[_Registration] = []
        self._ended: OrderedDict[str, tuple[str, str]] = OrderedDict()  # transfer id -> (state, why)
        self._declined: OrderedDict[str, None] = OrderedDict()  # D gave up before registering
        self._active: list[_Job] = []  # jobs this step computes
        self._write_bytes: dict[int, int] = {}  # id(handle) -> bytes, until it settles
        self._stats: dict[str, float] = {}

    def has_pending(self) -> bool:
        return bool(self._jobs or self._waiting)

    # ---------------------------------------------------------------- engine thread: steps

    def begin_step(self, meta: NixlPushMetadata) -> None:
        with self._lock:
            for step in meta.steps:
                job = self._job_for(step.transfer_id, step.req_id, step.num_prompt_tokens, step.prompt_digest)
                moved = job.block_ids != step.block_ids[:len(job.block_ids)]
                if step.num_computed_before < job.ready or moved:
                    job.sent = [0] * self.num_layers  # preempted and recomputed: send it all again
                    job.digests = None
                job.block_ids = list(step.block_ids)
                job.ready, job.step_end, job.started = step.num_computed_before, step.num_computed_after, True
                self._active.append(job)
            for hold in meta.holds:
                job = self._job_for(hold.transfer_id, hold.req_id, 0, b"")
                job.finished, job.complete = True, hold.complete
                job.hold_expires = time.monotonic() + hold.lease_seconds
                if not hold.complete and job.registration is not None:
                    job.registration.failure = "the prefill instance aborted the request"
        self._connect_and_catch_up()

    def save_layer(self, layer: int) -> None:
        for job in self._active:
            job.layers_computed += 1
            if job.step_end is not None:
                self._fold(job, layer, job.step_end)
                if self.config.layerwise:
                    self._push(job, [layer], job.step_end)

    def _fold(self, job: _Job, layer: int, upto: int) -> None:
        """Fold `layer`'s blocks that are final at `upto` tokens into the job's checksums, so the
        completing write has only the last layer's share left to add."""
        num_prompt_blocks = _cdiv(job.num_prompt_tokens, self.block_size)
        if job.digests is None:
            job.digests = security.DigestFold(self.kv_layers, num_prompt_blocks)
        # NOTE: a partial last block changes until the prompt is complete; fold it only then
        final = num_prompt_blocks if upto >= job.num_prompt_tokens else upto // self.block_size
        job.digests.fold(layer, job.block_ids, final)

    def end_step(self) -> None:
        """wait_for_save: a step's writes finish before the next step may rewrite the pages.

        NOTE: the bound on the lag is one step. A chunk's partial last block is written again
        with the next chunk; waiting here keeps the older write from landing after the newer."""
        for job in self._active:
            if job.step_end is not None:
                if job.step_end < job.num_prompt_tokens and job.writes:
                    self._settle_writes(job)
                job.ready, job.step_end = job.step_end, None
                if not self.config.layerwise and job.ready >= job.num_prompt_tokens:
                    self._catch_up(job)  # after prefill: the whole prompt in one write
        self._active = []

    def _job_for(self, transfer_id: str, req_id: str, num_prompt_tokens: int, digest: bytes) -> _Job:
        job = self._jobs.get(transfer_id)
        if job is None:
            job = _Job(transfer_id, req_id, num_prompt_tokens, digest, [], [0] * self.num_layers)
            job.declined = transfer_id in self._declined
            self._declined.pop(transfer_id, None)
            self._jobs[transfer_id] = job
            early = self._waiting.pop(transfer_id, None)
            if early is not None:
                problem = self._mismatch(job, early.request) if num_prompt_tokens else None
                if problem is None:
                    job.registration = early
                else:
                    self._remember(transfer_id, PUSH_REFUSED, problem)
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
            if job.step_end is None and done and self._writable(job.registration):
                self._catch_up(job)

    def _catch_up(self, job: _Job) -> None:
        """Write every layer up to what is computed (a late registration; or a step's end)."""
        if len(set(job.sent)) == 1:
            self._push(job, list(range(self.num_layers)), job.ready)
            return
        for layer in range(self.num_layers):
            self._push(job, [layer], job.ready)

    def _writable(self, reg: _Registration | None) -> bool:
        return (reg is not None and reg.connected and not reg.cancelled and not reg.failure
                and reg.final is None and time.monotonic() < reg.expires)

    def _push(self, job: _Job, layers: list[int], upto: int) -> None:
        """Write `layers`' blocks for tokens [sent, upto) into D's registered blocks."""
        reg = job.registration
        if reg is None or not self._writable(reg) or upto <= 0:
            return
        req = reg.request
        num_prompt_blocks = _cdiv(job.num_prompt_tokens, self.block_size)
        sent = job.sent[layers[0]]
        start, end = max(req.first_block, sent // self.block_size), min(_cdiv(upto, self.block_size),
                                                                         num_prompt_blocks)
        others_done = all(job.sent[i] >= job.num_prompt_tokens
                          for i in range(self.num_layers) if i not in layers)
        final = upto >= job.num_prompt_tokens and others_done
        new_sent = upto if upto >= job.num_prompt_tokens else upto // self.block_size * self.block_size
        if end <= start and not final:  # nothing D lacks in this range (its local hit covers it)
            for layer in layers:
                job.sent[layer] = max(job.sent[layer], new_sent)
            return
        # NOTE: a one-sided write lands unseen by D: its notification tells D what landed, so D
        # sums those blocks then rather than every block of every layer at the end
        landed = (PushLanded(job.transfer_id, req.registration_id, list(layers), start, end)
                  if end > start and not self.transport.sees_writes else None)
        notification = landed.encode() if landed is not None else b""
        if final:
            if not self._settle_writes(job):
                return
            if job.digests is None:
                job.digests = security.DigestFold(self.kv_layers, num_prompt_blocks)
            checksums = job.digests.digests(job.block_ids, req.first_block)
            notification = PushNotification(job.transfer_id, req.registration_id, checksums,
                                            landed, reg.num_landed).encode()
        local = job.block_ids[start:end] if end > start else []
        remote = req.block_ids[start - req.first_block:end - req.first_block] if end > start else []
        with self._lock:  # NOTE: checked and started under the lock that a cancel takes
            if not self._writable(reg):
                return
            try:
                handle = self.transport.write_blocks(reg.remote_name, local, remote, notification, layers)
            except Exception as e:
                reg.failure = f"the transport refused the write: {e}"
                return
            job.writes.append(handle)
            if landed is not None and not final:
                reg.num_landed += 1
            self._write_bytes[id(handle)] = len(local) * len(layers) * self.layout.block_bytes
            if final:
                reg.final = handle
        for layer in layers:
            job.sent[layer] = max(job.sent[layer], new_sent)

    def _settle_writes(self, job: _Job) -> bool:
        """Wait (bounded) until the job's earlier writes are done: the completing write must
        not overtake them. False when one failed or they took too long (the push fails)."""
        deadline = time.monotonic() + self.config.transfer_timeout_seconds
        while True:
            self._prune(job)
            reg = job.registration
            if reg is None or reg.failure:
                return False
            if not job.writes:
                return True
            if time.monotonic() > deadline:
                reg.failure = f"writes did not finish within {self.config.transfer_timeout_seconds:.1f} s"
                return False
            time.sleep(0.0002)

    def _prune(self, job: _Job) -> None:
        """Drop the job's finished writes; a failed one fails its registration."""
        with self._lock:
            still: list[TransferHandle] = []
            for handle in job.writes:
                state = handle.poll()
                if state == TransferState.PENDING:
                    still.append(handle)
                    continue
                reg = job.registration
                num_bytes = self._write_bytes.pop(id(handle), 0)
                if state == TransferState.DONE:  # NOTE: counted once landed, not when started
                    self._count("bytes_saved", num_bytes)
                if state == TransferState.ERROR and reg is not None and not reg.failure:
                    reg.failure = f"a write failed: {handle.error}"
                    self._count("save_failures")
                if reg is not None and handle is reg.final and state == TransferState.DONE:
                    reg.final_done = True
                handle.release()
            job.writes = still

    # ---------------------------------------------------------------- engine thread: every step

    def poll(self) -> tuple[set[str], dict[str, float]]:
        """Requests whose blocks may be freed now, and this step's statistics."""
        self._connect_and_catch_up()
        ended: set[str] = set()
        now = time.monotonic()
        with self._lock:
            for transfer_id, reg in list(self._waiting.items()):
                if now >= reg.match_by:  # its request never started here
                    del self._waiting[transfer_id]
                    self._remember(transfer_id, PUSH_REFUSED, "no request with this transfer id started here")
        for job in list(self._jobs.values()):
            self._prune(job)
            reason = self._end_reason(job, now)
            if reason is not None and not job.writes:
                with self._lock:
                    del self._jobs[job.transfer_id]
                    self._remember(job.transfer_id, *reason)
                if job.finished:
                    ended.add(job.req_id)
        stats, self._stats = self._stats, {}
        return ended, stats

    def _end_reason(self, job: _Job, now: float) -> tuple[str, str] | None:
        reg = job.registration
        if reg is not None and not reg.final_done and not reg.failure and now >= reg.expires:
            reg.failure = "the registration's lease expired (no heartbeat from the decode instance)"
        if not job.finished:
            return None
        if not job.complete:
            return PUSH_FAILED, "the prefill instance aborted the request"
        if reg is None:
            if job.declined:
                return PUSH_FAILED, "the decode instance gave up before registering"
            if now < job.hold_expires:
                return None
            self._count("lease_expired")
            logger.info("NixlPushConnector: nobody registered for %s; freeing its blocks", job.transfer_id)
            return PUSH_REFUSED, "the request's lease expired before a decode instance registered"
        if reg.final_done:
            return PUSH_WRITTEN, ""
        if reg.failure or reg.cancelled:
            return PUSH_FAILED, reg.failure or "cancelled by the decode instance"
        return None

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
        problem = self._blocks_problem(request)
        if problem is not None:
            return refuse(problem)
        now = time.monotonic()
        with self._lock:
            ended = self._ended.get(request.transfer_id)
            if ended is not None:
                return refuse(f"the request already ended here: {ended[1] or ended[0]}")
            job = self._jobs.get(request.transfer_id)
            if job is not None and job.started:
                problem = self._mismatch(job, request)
                if problem is None and job.registration is not None:
                    problem = "another decode instance already registered for this request"
                if problem is None and job.finished and not job.complete:
                    problem = "the prefill instance aborted the request"
                if problem is not None:
                    return refuse(problem)
            lease_s = min(self.reg_lease_s, request.max_lease_s or self.reg_lease_s)
            reg = _Registration(request, f"{request.engine_id}/{request.instance_id}", lease_s,
                                expires=now + lease_s,
                                match_by=now + self.config.transfer_timeout_seconds)
            if job is not None and job.started:
                job.registration = reg
            elif len(self._waiting) >= _MAX_WAITING:
                return refuse(f"{_MAX_WAITING} registrations already wait for requests that have not started")
            else:
                self._waiting[request.transfer_id] = reg
            self._to_connect.append(reg)
            return self._status(request.transfer_id, reg, now)

    def _blocks_problem(self, request: PushRegister) -> str | None:
        num_prompt_blocks = _cdiv(request.num_prompt_tokens, self.block_size)
        if not 0 <= request.first_block <= num_prompt_blocks:
            return f"first_block {request.first_block} is outside the prompt's {num_prompt_blocks} blocks"
        if len(request.block_ids) != num_prompt_blocks - request.first_block:
            return (f"{len(request.block_ids)} blocks registered for prompt blocks {request.first_block}.."
                    f"{num_prompt_blocks - 1}")
        bad = [b for b in request.block_ids if not 0 <= b < request.num_blocks]
        if bad or len(set(request.block_ids)) != len(request.block_ids):
            return f"the registered block ids are not distinct blocks of a {request.num_blocks}-block pool"
        return None

    @staticmethod
    def _mismatch(job: _Job, request: PushRegister) -> str | None:
        if request.prompt_digest != job.prompt_digest or request.num_prompt_tokens != job.num_prompt_tokens:
            return "the registration's prompt does not match the request's"
        return None

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
                reg = self._find(ref)
                if reg is not None and fresh:
                    reg.expires = max(reg.expires, now + reg.lease_s)
                statuses.append(self._status(ref.transfer_id, reg, now))
            return statuses

    def cancel(self, ref: PushRef) -> PushStatus:
        """D gives up (or aborted): no new write starts; "cancelled" once none is in flight."""
        with self._lock:
            reg = self._find(ref)
            if reg is None:  # D gave up before registering: free the request once it finishes
                job = self._jobs.get(ref.transfer_id)
                if job is not None and job.registration is None:
                    job.declined = True
                elif job is None:
                    self._declined[ref.transfer_id] = None
                    while len(self._declined) > _MAX_REMEMBERED:
                        self._declined.popitem(last=False)
                return PushStatus(transfer_id=ref.transfer_id, state=PUSH_CANCELLED)
            reg.cancelled = True
            if self._waiting.get(ref.transfer_id) is reg:
                # NOTE: kept (cancelled) until its request arrives, so P frees that request's
                # blocks as soon as it finishes rather than holding them for the lease.
                return PushStatus(transfer_id=ref.transfer_id, state=PUSH_CANCELLED)
            job = self._jobs.get(ref.transfer_id)
            busy = job is not None and bool(job.writes)
            return PushStatus(transfer_id=ref.transfer_id, state=PUSH_CANCELLING if busy else PUSH_CANCELLED)

    def _find(self, ref: PushRef) -> _Registration | None:
        job = self._jobs.get(ref.transfer_id)
        reg = job.registration if job is not None else self._waiting.get(ref.transfer_id)
        return reg if reg is not None and reg.request.registration_id == ref.registration_id else None

    def _status(self, transfer_id: str, reg: _Registration | None, now: float) -> PushStatus:
        job = self._jobs.get(transfer_id)
        if reg is None:
            state, why = self._ended.get(transfer_id, (PUSH_REFUSED, "no such registration here"))
            return PushStatus(transfer_id=transfer_id, state=state, error=why)
        if reg.failure or reg.cancelled:
            return PushStatus(transfer_id=transfer_id, state=PUSH_FAILED, error=reg.failure or "cancelled")
        if job is None or not job.started:
            if now >= reg.match_by:
                self._waiting.pop(transfer_id, None)
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

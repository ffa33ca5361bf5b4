"""P's bookkeeping of a push: a job per request, the D ranks that read it, their registrations.

Between tensor-parallel instances of different sizes one of P's ranks may write to several of D's
ranks (each its KV heads' byte ranges of every block, nixl_tp.plan_writes), or to none. Which
ones is known once a registration (or a decline) states D's tp_size; P computes the plan itself
and takes a registration only from a D rank the plan names, with exactly the plan's ranges.
A job's blocks are freed only when every reader's push ended (written, failed, cancelled,
expired, or declined before registering) and no write is in flight. Nothing here talks to the
network or the transport.

The checks of a registration live here too: P trusts neither D's ranges nor its block size,
only its own plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvrelay.kv_transfer.p2p.tp_plan import RankRead, plan_writes
from kvrelay.kv_transfer.push.meta import (
    PUSH_CANCELLED,
    PUSH_FAILED,
    PUSH_REFUSED,
    PUSH_WRITTEN,
    PushRef,
    PushRegister,
)
from kvrelay.kv_transfer.transport.base import ByteRange, TransferHandle
from kvrelay.model.sharding import kv_heads_of_rank
from kvrelay.utils import cdiv

if TYPE_CHECKING:
    from kvrelay.kv_transfer.p2p import security


LEASE_EXPIRED = (PUSH_REFUSED, "the request's lease expired before every decode rank registered")


@dataclass
class Registration:
    """One D rank's registration: where its blocks are, what to write there, how far it got."""

    request: PushRegister
    remote_name: str  # the transport's name for D's rank: engine id and instance, so a restart is new
    lease_s: float
    expires: float  # monotonic: P starts no write for it after this
    match_by: float  # monotonic: refused unless its request started here by then
    num_layers: int
    # NOTE: in write_blocks' terms: local_offset in P's block, remote_offset in D's (None: whole blocks)
    ranges: tuple[ByteRange, ...] | None = None
    connected: bool = False  # D's agent added to the transport (engine thread)
    cancelled: bool = False
    refused: bool = False  # never accepted after all (its prompt differs from the request's)
    failure: str = ""
    final: TransferHandle | None = None  # the completing write
    final_done: bool = False
    num_landed: int = 0  # earlier writes that went out with a PushLanded (one-sided transports)
    sent: list[int] = field(default_factory=list)  # per layer: prompt tokens D holds (or is being sent)
    writes: list[TransferHandle] = field(default_factory=list)
    digests: security.DigestFold | None = None  # checksums of what it writes, folded as blocks become final

    def __post_init__(self) -> None:
        self.sent = [0] * self.num_layers

    @property
    def ref(self) -> PushRef:
        return PushRef(self.request.transfer_id, self.request.registration_id)

    @property
    def d_rank(self) -> int:
        return self.request.tp_rank

    @property
    def ended(self) -> bool:
        """Nothing more will be written for it (writes may still be in flight)."""
        return self.final_done or self.cancelled or bool(self.failure)

    @property
    def local_ranges(self) -> list[tuple[int, int]] | None:
        """The (offset, length) ranges of P's blocks it writes: what its checksums cover."""
        return None if self.ranges is None else [(r.local_offset, r.length) for r in self.ranges]

    def reset(self) -> None:
        """P's request was preempted and is computed again: send it all again."""
        self.sent = [0] * self.num_layers
        self.digests = None


def write_ranges(read: RankRead) -> tuple[ByteRange, ...] | None:
    """A D rank's read plan (remote = P's offset, local = D's) in write_blocks' terms."""
    if read.ranges is None:
        return None
    return tuple(ByteRange(r.local_offset, r.remote_offset, r.length) for r in read.ranges)


@dataclass
class Readers:
    """Who takes a job's KV: the D ranks whose plan reads from this P rank (fixed by the first
    registration or decline that states D's tp_size), their registrations, the ones that declined."""

    d_tp: int = 0  # 0: not known yet
    expected: frozenset[int] = frozenset()  # the D ranks that read from this P rank
    registrations: dict[int, Registration] = field(default_factory=dict)  # by D rank
    declined: set[int] = field(default_factory=set)  # D ranks that will not register
    declined_all: bool = False  # a decline that states no tp_size (nobody will register)

    def fix_tp(self, d_tp: int, expected: frozenset[int]) -> str | None:
        """Why a D rank of a `d_tp` instance cannot join (another size came first), or None."""
        if self.d_tp == 0:
            self.d_tp, self.expected = d_tp, expected
        elif d_tp != self.d_tp:
            return (f"a decode rank of tensor_parallel_size {d_tp} registered for a request a decode rank "
                    f"of tensor_parallel_size {self.d_tp} already did")
        return None

    def find(self, registration_id: str) -> Registration | None:
        for reg in self.registrations.values():
            if reg.request.registration_id == registration_id:
                return reg
        return None

    @property
    def accounted(self) -> bool:
        """Every reader registered or declined: nobody more will register."""
        known = set(self.registrations) | self.declined
        return self.declined_all or (self.d_tp > 0 and self.expected <= known)

    @property
    def match_by(self) -> float:
        """The earliest time a registration waiting for its request gives up (inf: none waits)."""
        return min((reg.match_by for reg in self.registrations.values()), default=float("inf"))


@dataclass
class Job:
    """A push request on P, from its first computing step until its blocks are freed."""

    transfer_id: str
    req_id: str
    num_prompt_tokens: int
    prompt_digest: bytes
    block_ids: list[int]
    readers: Readers = field(default_factory=Readers)
    ready: int = 0  # tokens whose KV exists in every layer
    step_end: int | None = None  # this step's forward computes up to here, layer by layer
    layers_computed: int = 0  # progress D sees: advances with every layer of every chunk
    started: bool = False  # a step computed it (False: known from a hold only)
    finished: bool = False
    complete: bool = False
    hold_expires: float = float("inf")

    @property
    def registrations(self) -> list[Registration]:
        return list(self.readers.registrations.values())

    @property
    def writing(self) -> bool:
        """A write of the job is in flight (or not yet pruned)."""
        return any(reg.writes for reg in self.readers.registrations.values())

    def end_reason(self, now: float) -> tuple[str, str] | None:
        """(state, why) once the job may end (its blocks freed when no write is in flight)."""
        regs = self.registrations
        for reg in regs:
            if not reg.final_done and not reg.failure and now >= reg.expires:
                reg.failure = "the registration's lease expired (no heartbeat from the decode instance)"
        if not self.finished:
            return None
        if not self.complete:
            return PUSH_FAILED, "the prefill instance aborted the request"
        if not all(reg.ended for reg in regs):
            return None
        readers = self.readers
        if not readers.accounted:
            return None if now < self.hold_expires else LEASE_EXPIRED
        failed = [reg for reg in regs if not reg.final_done]
        if failed:
            return PUSH_FAILED, failed[0].failure or "cancelled by the decode instance"
        if readers.declined_all or readers.declined & readers.expected:
            return PUSH_FAILED, "the decode instance gave up before registering"
        if not regs:
            return PUSH_CANCELLED, "no decode rank reads from this rank"
        return PUSH_WRITTEN, ""


# ---------------------------------------------------------------- what P checks in a registration


def reader_plan(request: PushRegister, num_kv_heads: int, p_tp: int, p_rank: int, head_bytes: int,
                p_block_bytes: int) -> tuple[RankRead | None, str | None]:
    """What the registering D rank reads from P rank `p_rank` by P's own plan, or why it cannot
    register here (its size cannot pair, its plan reads nothing here, its ranges or block size
    differ from the plan's)."""
    d_tp, d_rank = request.tp_size, request.tp_rank
    try:
        if not 0 <= d_rank < d_tp:
            raise ValueError(f"rank {d_rank} is outside its tensor_parallel_size {d_tp}")
        writes = plan_writes(num_kv_heads, p_tp, d_tp, p_rank, head_bytes)
        d_block_bytes = 2 * len(kv_heads_of_rank(num_kv_heads, d_tp, d_rank)) * head_bytes
    except ValueError as e:
        return None, (f"a tensor_parallel_size {d_tp} decode instance cannot take KV from this "
                      f"tensor_parallel_size {p_tp} prefill instance: {e}")
    read = writes.get(d_rank)
    where = f"rank {d_rank} of a tensor_parallel_size {d_tp} decode instance"
    if read is None:
        return None, (f"{where} reads none of its KV heads from rank {p_rank} of this tensor_parallel_size "
                      f"{p_tp} prefill instance")
    stated = None if request.ranges is None else tuple(ByteRange(*r) for r in request.ranges)
    if stated != read.ranges:
        return None, f"{where} registered byte ranges {stated}, the plan says {read.ranges}"
    if read.ranges is None:
        d_block_bytes = p_block_bytes  # whole blocks: the same heads on both sides
    if request.block_bytes != d_block_bytes:
        return None, f"{where} has {request.block_bytes}-byte blocks, the plan {d_block_bytes}"
    return read, None


def blocks_problem(request: PushRegister, block_size: int) -> str | None:
    """Why the registered blocks cannot hold the prompt's blocks from `first_block` on, or None."""
    num_prompt_blocks = cdiv(request.num_prompt_tokens, block_size)
    if not 0 <= request.first_block <= num_prompt_blocks:
        return f"first_block {request.first_block} is outside the prompt's {num_prompt_blocks} blocks"
    if len(request.block_ids) != num_prompt_blocks - request.first_block:
        return (f"{len(request.block_ids)} blocks registered for prompt blocks {request.first_block}.."
                f"{num_prompt_blocks - 1}")
    bad = [b for b in request.block_ids if not 0 <= b < request.num_blocks]
    if bad or len(set(request.block_ids)) != len(request.block_ids):
        return f"the registered block ids are not distinct blocks of a {request.num_blocks}-block pool"
    return None


def prompt_mismatch(job: Job, request: PushRegister) -> str | None:
    if request.prompt_digest != job.prompt_digest or request.num_prompt_tokens != job.num_prompt_tokens:
        return "the registration's prompt does not match the request's"
    return None

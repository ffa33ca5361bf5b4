"""D's bookkeeping of a push: its peers (P's ranks), a request's receives, and what settled.

A request's receive is one `RankRecv` per P rank whose KV heads this D rank holds (p2p/tp_plan.py:
one between equal TP sizes, several when this rank's heads live on several of P's ranks), grouped
under one `RequestRecvs` that settles once, when all of them did. `handshake_problem` says
whether a P rank's handshake pairs with this rank. Nothing here talks to the network.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from kvrelay.kv_transfer.compat import kv_incompatibility
from kvrelay.kv_transfer.p2p import security
from kvrelay.kv_transfer.p2p.handshake import HandshakeAnswered, HandshakeReply, LocalIdentity
from kvrelay.kv_transfer.p2p.tp_plan import RankRead, plan_reads
from kvrelay.kv_transfer.push.meta import PushLanded, PushRecv, PushRef, PushStatus
from kvrelay.kv_transfer.side_channel import PeerThread
from kvrelay.model.sharding import kv_heads_of_rank

logger = logging.getLogger(__name__)


@dataclass
class PushPeer:
    """One of a prefill instance's ranks (its side channel listens on kv_port + p_rank)."""

    host: str
    port: int
    p_rank: int  # 0: the base port, whose handshake tells D the prefill instance's tp_size
    thread: PeerThread
    reply: HandshakeReply | None = None
    refs: tuple[PushRef, ...] = ()  # what the heartbeats renew (read by the peer thread)
    last_beat_sent: float = 0.0  # monotonic, written by the peer thread

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port


class RecvStage(StrEnum):
    """Where a receive is. One given up waits in CANCELLING until P confirmed no write of its is
    or will be in flight (or P's lease on the registration ran out)."""

    HANDSHAKE = "handshake"  # until that P rank answered the handshake
    REGISTER = "register"  # until P accepted the registration
    WAITING = "waiting"  # P writes as it computes; the completing write ends it
    CANCELLING = "cancelling"


@dataclass
class RankRecv:
    """A request's receive from one P rank: its registration there, and P's writes."""

    spec: PushRecv
    source: RankRead  # what this rank takes from that P rank (ranges: remote = P's, local = ours)
    port: int  # that P rank's side channel
    registration_id: str
    deadline: float  # monotonic: fail unless P made progress by then
    stage: RecvStage = RecvStage.HANDSHAKE
    contacted: bool = False  # a registration went out: P may write until told otherwise
    last_contact: float = 0.0  # when P last (possibly) renewed its lease, by our clock
    lease_s: float = 0.0
    progress: int = -1
    written_seen: bool = False
    safe: bool = False  # P confirmed no write is or will be in flight
    safe_after: float = float("inf")
    aborted: bool = False
    failure: str = ""
    count_failure: bool = True  # False: given up because a sibling failed (that one counts)
    landed: security.LandedSums | None = None  # checksum sums of the writes as they land
    num_landed: int = 0  # PushLanded notifications recorded (one-sided transports)

    @property
    def key(self) -> tuple[str, int]:
        return self.spec.req_id, self.source.p_rank

    @property
    def address(self) -> tuple[str, int]:
        return self.spec.remote_host, self.port

    def never_started(self) -> str:
        """"; " and the likely cause when P took the registration but never started the request
        (else ""): what D's failure message adds."""
        if self.stage != RecvStage.WAITING or self.progress >= 0 or self.written_seen:
            return ""
        return ("; P never started this request: its prefill leg did not reach P in push mode, most "
                "likely because a proxy in pull mode (the default) fronts these NixlPushConnector "
                "instances (start `kvrelay proxy` with --transfer-mode push --prefill-kv HOST:PORT), or "
                "that leg failed (see the proxy's log)")

    def record_landed(self, note: PushLanded, num_layers: int) -> None:
        """A one-sided write's bytes landed: sum its blocks now (the prompt blocks [start, end)
        sit in the local blocks the registration listed from `first_block` on)."""
        spec, first = self.spec, self.spec.first_block
        layers_ok = all(0 <= layer < num_layers for layer in note.layers)
        if not (first <= note.start < note.end <= first + len(spec.local_block_ids) and layers_ok):
            logger.warning("NixlPushConnector: request %s: a landed write names prompt blocks [%d, %d) "
                           "layers %s outside its registration; verifying at the end instead",
                           spec.req_id, note.start, note.end, note.layers[:8])
            self.landed = None
            return
        self.record_writes(spec.local_block_ids[note.start - first:note.end - first], note.layers)

    def record_writes(self, block_ids: Sequence[int], layers: Sequence[int]) -> None:
        """Take the checksum sums of a write that landed (the engine thread, or a transport
        thread where D sees writes land). A sum that fails never breaks the write: the
        completing write then counts every layer of every block again."""
        landed = self.landed
        if landed is None:
            return
        try:
            landed.record(block_ids, layers)
        except Exception:
            logger.exception("NixlPushConnector: cannot sum a landed write; verifying at the end instead")
            self.landed = None

    @property
    def local_ranges(self) -> list[tuple[int, int]] | None:
        """The (offset, length) byte ranges of our blocks it fills (None: whole blocks)."""
        ranges = self.source.ranges
        return None if ranges is None else [(r.local_offset, r.length) for r in ranges]


@dataclass
class RequestRecvs:
    """A request's receives (one per P rank): it settles once, when all of them did."""

    spec: PushRecv
    pending: int
    started: float = field(default_factory=time.monotonic)
    failed: bool = False
    count_failure: bool = False  # a failure to report as one (not an abort)
    invalid_block_ids: set[int] = field(default_factory=set)


# What a peer thread posts to the engine thread (push/messages.py), which drains them in
# `PushReceiver.poll`.


@dataclass(frozen=True)
class RegisterAnswered:
    recv: RankRecv
    status: PushStatus | None
    error: str | None  # why there is no status
    received_at: float  # monotonic
    sender: str  # the answering P process's instance id ("" without an answer)


@dataclass(frozen=True)
class PushHeartbeatAnswered:
    peer: PushPeer
    refs: tuple[PushRef, ...]  # what the heartbeat renewed
    statuses: list[PushStatus]
    sent_at: float  # monotonic
    received_at: float
    sender: str


@dataclass(frozen=True)
class CancelAnswered:
    recv: RankRecv
    status: PushStatus
    sender: str


RecvEvent = HandshakeAnswered[PushPeer] | RegisterAnswered | PushHeartbeatAnswered | CancelAnswered


@dataclass
class Planning:
    """A request waiting for the base port's handshake, which says P's tp_size (and so the plan)."""

    spec: PushRecv
    base: tuple[str, int]
    deadline: float


def handshake_problem(me: LocalIdentity, peer: PushPeer, reply: HandshakeReply, base_tp: int) -> str | None:
    """Why this D rank cannot take pushed KV from the P rank that answered the handshake, or
    None. `base_tp`: the tp_size P's base port (rank 0) stated; every rank must state the same."""
    where = f"the prefill instance at {peer.host}:{peer.port} (engine {reply.engine_id})"
    mode = getattr(reply, "transfer_mode", "pull")
    if mode != "push":
        return (f"{where} runs transfer_mode {mode!r} (NixlConnector) and this decode instance "
                "'push' (NixlPushConnector): run both with the same kv_connector")
    difference = kv_incompatibility(me.fingerprint, me.fingerprint_digest, me.tp_size,
                                    reply.fingerprint, reply.fingerprint_digest, reply.tp_size)
    if difference is not None:
        return f"{where} runs another model or KV format ({difference})"
    try:
        plan_reads(me.num_kv_heads, reply.tp_size, me.tp_size, me.tp_rank, me.head_bytes)
        p_heads = kv_heads_of_rank(me.num_kv_heads, reply.tp_size, peer.p_rank)
    except ValueError as e:
        return (f"{where} runs tensor_parallel_size {reply.tp_size} and this decode instance "
                f"{me.tp_size}, which cannot pair: {e}")
    mismatches = [(name, theirs, ours) for name, theirs, ours in (
        ("backend", reply.backend, me.backend), ("block_size", reply.block_size, me.block_size),
        ("num_layers", len(reply.layer_names), len(me.layout.layer_names)),
        ("block_bytes", reply.block_bytes, 2 * len(p_heads) * me.head_bytes),
        ("tp_size", reply.tp_size, base_tp), ("tp_rank", reply.tp_rank, peer.p_rank))
        if theirs != ours]
    if mismatches:
        text = ", ".join(f"{name}: theirs {theirs!r}, ours {ours!r}" for name, theirs, ours in mismatches)
        return f"{where} has an incompatible KV layout ({text}); configure both instances alike"
    return None

"""The pull connector's bookkeeping on D: its peers (P ranks) and its pulls.

A request's load is one `RankPull` per P rank it reads from (p2p/tp_plan.py), grouped under one
`RequestPulls` that settles once, when all of them did. Nothing here talks to the network.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from kvrelay.kv_transfer.p2p.handshake import HandshakeAnswered, HandshakeReply
from kvrelay.kv_transfer.p2p.tp_plan import RankRead
from kvrelay.kv_transfer.pull.meta import LeaseRef, LeaseStatus, PullSpec
from kvrelay.kv_transfer.side_channel import PeerThread
from kvrelay.kv_transfer.transport.base import TransferHandle


@dataclass
class Peer:
    """One of a prefill instance's ranks (its side channel listens on kv_port + p_rank)."""

    key: str  # "{engine_id}#{p_rank}": the peer table's and the transport's name for it
    engine_id: str
    p_rank: int
    tp_size: int  # P's, as the params say
    block_bytes: int  # what a block of this rank must measure
    host: str
    port: int
    thread: PeerThread
    reply: HandshakeReply | None = None  # set once the handshake succeeded
    leases: tuple[LeaseRef, ...] = ()  # what the heartbeats keep alive (read by the peer thread)


class PullStage(StrEnum):
    """Where a pull is. A pull given up while its read is in flight waits in CANCELLING until the
    transport settled the read, so no byte lands in a block the scheduler handed on."""

    HANDSHAKE = "handshake"  # until its peer answered the handshake
    PIN = "pin"  # until P pinned the lease (and sent the blocks' checksums)
    READING = "reading"  # the transport reads
    CANCELLING = "cancelling"


@dataclass
class RankPull:
    """A request's read from one P rank."""

    spec: PullSpec
    source: RankRead
    peer_key: str
    deadline: float  # time.monotonic()
    stage: PullStage = PullStage.HANDSHAKE
    handle: TransferHandle | None = None
    checksums: list[int] = field(default_factory=list)
    safe_until: float = 0.0  # P promised to hold the blocks until then (monotonic)
    read_started: float = 0.0
    aborted: bool = False
    failure: str = ""  # why a cancelling pull gave up
    release_on_settle: bool = False  # a cancelled read that does not complete must release P's lease
    source_layout: str = ""  # the block layout of P's KV (layouts.py); converted once read

    @property
    def key(self) -> tuple[str, int]:
        return self.spec.req_id, self.source.p_rank


# What a peer thread posts to the engine thread, which drains them in `Puller.poll`.


@dataclass(frozen=True)
class PinAnswered:
    peer: Peer
    pull_key: tuple[str, int]
    status: LeaseStatus | None
    error: str | None  # why there is no status
    sent_at: float  # monotonic: when the pin went out (P's lease counts from no earlier)
    sender: str  # the answering P process's instance id ("" without an answer)


@dataclass(frozen=True)
class HeartbeatAnswered:
    peer: Peer
    statuses: list[LeaseStatus]
    sent_at: float
    sender: str


PullEvent = HandshakeAnswered[Peer] | PinAnswered | HeartbeatAnswered


@dataclass
class RequestPulls:
    """A request's pulls (one per P rank): it settles once, when all of them did."""

    spec: PullSpec
    pending: int
    failed: bool = False
    count_failure: bool = False  # a failure to report as one (not an abort)
    invalid_block_ids: set[int] = field(default_factory=set)

"""The pull connector's bookkeeping on D: who this rank is, its peers (P ranks), and its pulls.

A request's load is one `RankPull` per P rank it reads from (nixl_tp.py), grouped under one
`RequestPulls` that settles once, when all of them did. Nothing here talks to the network.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, TypeVar

from kvrelay.kv_transfer.connectors.nixl_meta import HandshakeReply, LeaseRef, LeaseStatus, PullSpec
from kvrelay.kv_transfer.connectors.nixl_tp import RankRead
from kvrelay.kv_transfer.connectors.side_channel import PeerThread
from kvrelay.kv_transfer.transport.base import RegionLayout, TransferHandle
from kvrelay.model.sharding import kv_heads_of_rank


@dataclass(frozen=True)
class LocalIdentity:
    """What a peer must match before D reads its KV."""

    engine_id: str
    backend: str
    block_size: int
    fingerprint_digest: str
    fingerprint: dict[str, Any]
    layout: RegionLayout
    tp_rank: int = 0
    tp_size: int = 1
    num_kv_heads: int = 1  # the model's (the layout holds this rank's share)

    @property
    def head_bytes(self) -> int:
        """One KV head's K (or V) in one block of one layer (a block is [2, H_shard, bs, D])."""
        num_local_heads = len(kv_heads_of_rank(self.num_kv_heads, self.tp_size, self.tp_rank))
        return self.layout.block_bytes // (2 * num_local_heads)


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

    @property
    def key(self) -> tuple[str, int]:
        return self.spec.req_id, self.source.p_rank


# What a peer thread posts to the engine thread, which drains them in `Puller.poll`.


PeerT = TypeVar("PeerT")


@dataclass(frozen=True)
class HandshakeAnswered(Generic[PeerT]):
    """A P rank answered the handshake, or could not be reached (the push receiver posts it too,
    with its own kind of peer)."""

    peer: PeerT
    reply: HandshakeReply | None
    error: str | None  # why there is no reply


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


@dataclass
class PullResults:
    finished: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    stats: dict[str, float] = field(default_factory=dict)

    def count(self, key: str, value: float = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + value

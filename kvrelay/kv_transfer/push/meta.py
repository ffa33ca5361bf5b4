"""What the push connector passes around: per-step metadata (scheduler side -> worker side) and
the bodies of the push side-channel messages (decode instance -> prefill instance).

msgspec Structs throughout, so everything crosses a process or a machine as msgpack.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from kvrelay.kv_transfer.base import KVConnectorMetadata
from kvrelay.kv_transfer.transport.base import ByteRange

NOTIFICATION_PREFIX = b"kvrelay-push:"  # a PushNotification
LANDED_PREFIX = b"kvrelay-landed:"  # a PushLanded

_Note = TypeVar("_Note", bound=msgspec.Struct)

# ---------------------------------------------------------------- scheduler side -> worker side


class PushStep(msgspec.Struct, kw_only=True):
    """P: a push request computes prompt tokens in this step."""

    req_id: str
    transfer_id: str  # the id both legs share (the proxy's request id)
    block_ids: list[int]  # all its blocks so far, in token order
    num_computed_before: int  # prompt tokens whose KV existed before this step
    num_computed_after: int  # ... and after it (capped at the prompt)
    num_prompt_tokens: int
    prompt_digest: bytes


class PushHold(msgspec.Struct, kw_only=True):
    """P: a push request finished; its blocks stay until the push ends or the lease expires."""

    req_id: str
    transfer_id: str
    complete: bool  # the whole prompt's KV exists (False: aborted or failed before)
    lease_seconds: float


class PushRecv(msgspec.Struct, kw_only=True):
    """D: register `local_block_ids` with the prefill instance and wait for its writes."""

    req_id: str
    transfer_id: str
    remote_host: str
    remote_port: int
    prompt_digest: bytes
    num_prompt_tokens: int
    first_block: int  # the prompt block D's first registered block holds (after its local hit)
    local_block_ids: list[int]
    rejected: str | None = None  # the params were refused: fail at once, contact no one
    notify_only: bool = False  # a full local hit: register nothing, only let P free


class NixlPushMetadata(KVConnectorMetadata):
    steps: list[PushStep] = msgspec.field(default_factory=list)
    holds: list[PushHold] = msgspec.field(default_factory=list)
    recvs: list[PushRecv] = msgspec.field(default_factory=list)
    aborted_recvs: list[str] = msgspec.field(default_factory=list)


# ---------------------------------------------------------------- side-channel message bodies


class PushRegister(msgspec.Struct, kw_only=True):
    """D -> P: write the prompt blocks from `first_block` on into `block_ids`. Carries what P
    needs to reach D's memory (D's handshake, in the other direction)."""

    transfer_id: str
    registration_id: str  # random, chosen by D
    engine_id: str
    instance_id: str
    backend: str
    agent_metadata: bytes
    layer_names: list[str]
    num_blocks: int
    block_bytes: int
    base_addresses: list[int]
    device: str
    block_size: int
    fingerprint_digest: str
    prompt_digest: bytes
    num_prompt_tokens: int
    first_block: int
    block_ids: list[int]
    sent_at: float = 0.0  # unix time: P refuses a registration older than its transfer timeout
    # NOTE: D's own bounds, which D's wait-out after giving up relies on, so P honours them
    # even when its own timeout or lease is longer (0: not stated, P's own apply)
    max_age_s: float = 0.0  # P takes this registration (and its heartbeats) no older than this
    max_lease_s: float = 0.0  # P's lease on the registration: at most this from each renewal
    tp_size: int = 1  # D's tensor_parallel_size and this rank: P checks them against its own plan
    tp_rank: int = 0
    # NOTE: the byte ranges of each block D's plan takes from this P rank (remote = P's offset,
    # local = D's; None: whole blocks). P computes its own plan and refuses a registration whose
    # ranges differ.
    ranges: list[ByteRange] | None = None
    fingerprint: dict[str, Any] = msgspec.field(default_factory=dict)  # D's compatibility fingerprint


class PushCancel(msgspec.Struct, kw_only=True):
    """D -> P: stop writing for this registration; or, for a registration P never took, D's rank
    `tp_rank` (of `tp_size`) will not register: it gave up, needs nothing (a full local hit), or
    its plan reads nothing from any of this P rank's heads (then the plan's designated D rank
    says so, and P frees the request at once). tp_size 0: a D that does not say (nobody will)."""

    transfer_id: str
    registration_id: str
    tp_size: int = 0
    tp_rank: int = 0


class PushRef(msgspec.Struct, array_like=True):
    transfer_id: str
    registration_id: str


class PushHeartbeat(msgspec.Struct, kw_only=True):
    refs: list[PushRef]
    sent_at: float = 0.0  # unix time: a late heartbeat renews nothing
    max_age_s: float = 0.0  # a heartbeat older than this (or P's transfer timeout) renews nothing


# The states of a registration, as P reports them.
PUSH_WAITING = "waiting"  # registered; P has not started on the request yet
PUSH_WRITING = "writing"  # P computes and writes; num_computed says how far it got
PUSH_WRITTEN = "written"  # the completing write went out: its notification follows the bytes
PUSH_CANCELLED = "cancelled"  # no write in flight and none will start: D may reuse its blocks
PUSH_CANCELLING = "cancelling"  # cancelled, writes still in flight: ask again
PUSH_REFUSED = "refused"  # never accepted (unknown or expired request, mismatch): nothing written
PUSH_FAILED = "failed"  # P stopped writing (a write failed, P aborted the request)


class PushStatus(msgspec.Struct, kw_only=True):
    transfer_id: str
    state: str
    num_computed: int = 0
    layers_computed: int = 0  # attention layers P ran for the request so far: its heartbeat
    lease_s: float = 0.0  # P writes nothing for this registration after this many seconds
    error: str = ""


class PushStatuses(msgspec.Struct, kw_only=True):
    statuses: list[PushStatus]


class PushLanded(msgspec.Struct, array_like=True):
    """An earlier write's notification (one-sided transports): `layers` of the prompt blocks
    [start, end) now sit in D's registered blocks, so D may take their checksum sums."""

    transfer_id: str
    registration_id: str
    layers: list[int]
    start: int
    end: int

    def encode(self) -> bytes:
        return LANDED_PREFIX + msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, raw: bytes) -> PushLanded | None:
        return _decode(cls, LANDED_PREFIX, raw)


class PushNotification(msgspec.Struct, array_like=True):
    """The completing write's notification: which registration, and P's block checksums. Over a
    one-sided transport also what that write itself carried (`landed`) and how many earlier
    writes' `PushLanded` went out, so D knows whether its landed sums are whole."""

    transfer_id: str
    registration_id: str
    checksums: list[int]
    landed: PushLanded | None = None
    num_landed: int = 0

    def encode(self) -> bytes:
        return NOTIFICATION_PREFIX + msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, raw: bytes) -> PushNotification | None:
        return _decode(cls, NOTIFICATION_PREFIX, raw)


def _decode(cls: type[_Note], prefix: bytes, raw: bytes) -> _Note | None:
    if not raw.startswith(prefix):
        return None
    try:
        return msgspec.msgpack.decode(raw[len(prefix):], type=cls)
    except msgspec.DecodeError:
        return None

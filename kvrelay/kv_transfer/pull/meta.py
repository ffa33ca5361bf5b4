"""What the pull connector passes around: per-step metadata (scheduler side -> worker side) and
the bodies of the side-channel messages (decode instance <-> prefill instance).

Everything is a msgspec Struct, so it crosses a process or a machine as msgpack, never pickle.
"""

from __future__ import annotations

import msgspec

from kvrelay.kv_transfer.base import KVConnectorMetadata

# ---------------------------------------------------------------- scheduler side -> worker side


class PullSpec(msgspec.Struct, kw_only=True):
    """D: read `remote_block_ids` of a prefill instance into `local_block_ids`, pairwise."""

    req_id: str
    remote_request_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    lease_id: str
    prompt_digest: bytes
    local_block_ids: list[int]  # D's blocks that lack KV, in token order
    remote_block_ids: list[int]  # the LAST len(local_block_ids) blocks P offered
    # Why the params were refused on the scheduler side; the worker then fails the load at once
    # without contacting anyone (the failure policy applies).
    rejected: str | None = None
    # False: nothing to read (a full local prefix hit); only tell P it may free the blocks.
    notify_only: bool = False
    remote_tp_size: int = 1  # P's tensor_parallel_size (the params' `tp_size`)


class LeaseSpec(msgspec.Struct, kw_only=True):
    """P: hold `block_ids` of a finished request for a decode instance until it read them."""

    req_id: str
    lease_id: str
    block_ids: list[int]
    prompt_digest: bytes
    expiry_ms: int  # unix time in ms, as in the params


class NixlConnectorMetadata(KVConnectorMetadata):
    pulls: list[PullSpec] = msgspec.field(default_factory=list)
    leases: list[LeaseSpec] = msgspec.field(default_factory=list)
    aborted_pulls: list[str] = msgspec.field(default_factory=list)  # D: requests finished while loading


# ---------------------------------------------------------------- side-channel message bodies


class PinRequest(msgspec.Struct, kw_only=True):
    """D is about to read: check the lease, extend it, and send the blocks' checksums."""

    request_id: str
    lease_id: str
    block_ids: list[int]
    prompt_digest: bytes
    want_checksums: bool
    # The (offset, length) byte ranges of each block D reads (a KV-head slice, between TP sizes
    # that differ); the checksums then cover those bytes only. Empty: whole blocks.
    ranges: list[tuple[int, int]] = msgspec.field(default_factory=list)


class LeaseRef(msgspec.Struct, array_like=True):
    request_id: str
    lease_id: str


class HeartbeatRequest(msgspec.Struct, kw_only=True):
    leases: list[LeaseRef]


class ReleaseRequest(msgspec.Struct, kw_only=True):
    """D will not read (aborted, gave up): count it as one consumer done."""

    request_id: str
    lease_id: str
    num_consumers: int = 1


# The states a lease can be in, as P reports them.
LEASE_ALIVE = "alive"  # held; remaining_s says for how long at least
LEASE_PENDING = "pending"  # not registered yet (P's next step does it): ask again shortly
LEASE_GONE = "gone"  # freed (read, released or expired) or never issued by this instance
LEASE_REFUSED = "refused"  # exists, but the request does not match it


class LeaseStatus(msgspec.Struct, kw_only=True):
    request_id: str
    state: str
    remaining_s: float = 0.0
    checksums: list[int] = msgspec.field(default_factory=list)  # per pinned block (or its ranges), in order
    error: str = ""


class LeaseStatuses(msgspec.Struct, kw_only=True):
    statuses: list[LeaseStatus]

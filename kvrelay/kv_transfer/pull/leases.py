"""P's leases: the blocks of finished requests, held for the decode instances that will read them.

A lease starts when the scheduler side hands over a finished request (LeaseSpec, next step) and
ends when its consumers are done (one notification `"{request_id}:{n}"` per completed read, or a
release over the side channel, n in all) or when it expires. Pins and heartbeats from a decode
instance extend it. The engine thread adds leases, counts notifications and collects the ended
ones; the side-channel thread pins, touches and releases: one lock guards the table.

NOTE: a decode instance reads only after a successful pin, and only while the time the pin (or a
later heartbeat) promised has not run out, measured from before it asked. A lease is freed no
earlier than that promise, so no read ever touches a block after it went back to the pool.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvrelay.kv_transfer.p2p.lease_ids import lease_issued_ms
from kvrelay.kv_transfer.pull.meta import (
    LEASE_ALIVE,
    LEASE_GONE,
    LEASE_PENDING,
    LEASE_REFUSED,
    LeaseRef,
    LeaseSpec,
    LeaseStatus,
    PinRequest,
    ReleaseRequest,
)

logger = logging.getLogger(__name__)

_MAX_REMEMBERED = 4096  # ended leases (and early releases) remembered, to answer "gone"


@dataclass
class _Lease:
    spec: LeaseSpec
    expires: float  # time.monotonic()
    consumers_expected: int = 1
    consumers_done: int = 0
    checksums: dict[int, int] | None = None  # block id -> digest, computed when the lease starts


class LeaseTable:
    def __init__(self, lease_seconds: float,
                 checksum_fn: Callable[[Sequence[int], Sequence[tuple[int, int]] | None], list[int]]) -> None:
        self.lease_seconds = lease_seconds
        self._checksum_fn = checksum_fn
        self._started_ms = int(time.time() * 1000)
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # request id -> lease id
        self._early_releases: OrderedDict[str, ReleaseRequest] = OrderedDict()

    def __len__(self) -> int:
        return len(self._leases)

    # ---------------------------------------------------------------- engine thread

    def add(self, spec: LeaseSpec) -> None:
        """Start holding a finished request's blocks until the expiry written in its params."""
        expires = time.monotonic() + max(0.0, spec.expiry_ms / 1000 - time.time())
        # NOTE: the blocks no longer change once the request finished, so their checksums are
        # taken now, while D is still on its way: a pin then answers without reading the KV.
        block_ids = list(spec.block_ids)
        checksums = dict(zip(block_ids, self._checksum_fn(block_ids, None), strict=True))
        with self._lock:
            lease = _Lease(spec, expires, checksums=checksums)
            self._leases[spec.req_id] = lease
            early = self._early_releases.pop(spec.req_id, None)
            if early is not None and early.lease_id == spec.lease_id:
                self._count_done(lease, early.num_consumers)

    def on_notification(self, notification: bytes) -> None:
        """A completed read: `"{request_id}:{num_consumers}"`, sent by the transport."""
        request_id, _, count = notification.decode(errors="replace").rpartition(":")
        try:
            num_consumers = int(count)
        except ValueError:
            logger.warning("NixlConnector: ignoring malformed notification %r", notification)
            return
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None:
                self._count_done(lease, num_consumers)

    def take_ended(self) -> tuple[set[str], int]:
        """Requests whose blocks may be freed now, and how many of them expired unread."""
        now = time.monotonic()
        ended: set[str] = set()
        num_expired = 0
        with self._lock:
            for request_id, lease in list(self._leases.items()):
                done = lease.consumers_done >= lease.consumers_expected
                if not done and now < lease.expires:
                    continue
                if not done:
                    num_expired += 1
                    logger.info("NixlConnector: lease of request %s expired unread; freeing its "
                                "%d blocks", request_id, len(lease.spec.block_ids))
                del self._leases[request_id]
                self._remember(self._ended, request_id, lease.spec.lease_id)
                ended.add(request_id)
        return ended, num_expired

    def release_all(self) -> set[str]:
        """Shutdown: every lease ends now."""
        with self._lock:
            ended = set(self._leases)
            self._leases.clear()
        return ended

    # ---------------------------------------------------------------- side-channel thread

    def pin(self, request: PinRequest) -> LeaseStatus:
        """D is about to read `request.block_ids`: check them against the lease, extend it, and
        (when asked) checksum the blocks. Never reads a block outside a live lease."""
        with self._lock:
            status = self._check(request.request_id, request.lease_id)
            if status is not None:
                return status
            lease = self._leases[request.request_id]
            if request.prompt_digest != lease.spec.prompt_digest:
                return LeaseStatus(request_id=request.request_id, state=LEASE_REFUSED,
                                   error="the pin's prompt does not match the lease's")
            unknown = sorted(set(request.block_ids) - set(lease.spec.block_ids))
            if unknown:
                return LeaseStatus(request_id=request.request_id, state=LEASE_REFUSED,
                                   error=f"blocks {unknown} are not part of the lease")
            remaining = self._extend(lease)
            known = lease.checksums
        checksums: list[int] = []
        if request.want_checksums and request.ranges:  # a head slice: over the bytes D reads
            checksums = self._checksum_fn(request.block_ids, request.ranges)
        elif request.want_checksums:
            checksums = ([known[b] for b in request.block_ids] if known is not None
                         else self._checksum_fn(request.block_ids, None))
        return LeaseStatus(request_id=request.request_id, state=LEASE_ALIVE, remaining_s=remaining,
                           checksums=checksums)

    def touch(self, refs: Sequence[LeaseRef]) -> list[LeaseStatus]:
        """Heartbeat: extend every named lease that is alive; report the state of each."""
        statuses = []
        with self._lock:
            for ref in refs:
                status = self._check(ref.request_id, ref.lease_id)
                if status is None:
                    remaining = self._extend(self._leases[ref.request_id])
                    status = LeaseStatus(request_id=ref.request_id, state=LEASE_ALIVE, remaining_s=remaining)
                statuses.append(status)
        return statuses

    def release(self, request: ReleaseRequest) -> LeaseStatus:
        """A consumer will not read (aborted or gave up): it counts as done."""
        with self._lock:
            status = self._check(request.request_id, request.lease_id)
            if status is not None:
                if status.state == LEASE_PENDING:  # released before P even registered it
                    self._remember(self._early_releases, request.request_id, request)
                return status
            self._count_done(self._leases[request.request_id], request.num_consumers)
            return LeaseStatus(request_id=request.request_id, state=LEASE_GONE)

    # ---------------------------------------------------------------- helpers (lock held)

    def _check(self, request_id: str, lease_id: str) -> LeaseStatus | None:
        lease = self._leases.get(request_id)
        if lease is None:
            if request_id in self._ended:
                return LeaseStatus(request_id=request_id, state=LEASE_GONE,
                                   error="the lease ended (read, released or expired)")
            return self._unknown(request_id, lease_id)
        if lease.spec.lease_id != lease_id:
            return LeaseStatus(request_id=request_id, state=LEASE_GONE,
                               error="another lease holds this request id (restarted instance?)")
        if time.monotonic() >= lease.expires:
            return LeaseStatus(request_id=request_id, state=LEASE_GONE, error="the lease expired")
        return None

    def _unknown(self, request_id: str, lease_id: str) -> LeaseStatus:
        issued_ms = lease_issued_ms(lease_id)
        if issued_ms is None or issued_ms < self._started_ms:
            return LeaseStatus(request_id=request_id, state=LEASE_GONE,
                               error="the lease was issued before this instance started (restarted?)")
        if time.time() * 1000 > issued_ms + self.lease_seconds * 1000:
            return LeaseStatus(request_id=request_id, state=LEASE_GONE, error="unknown lease, expired anyway")
        # NOTE: issued moments ago: P registers a lease on the step after the request finished.
        return LeaseStatus(request_id=request_id, state=LEASE_PENDING)

    def _extend(self, lease: _Lease) -> float:
        lease.expires = max(lease.expires, time.monotonic() + self.lease_seconds)
        return lease.expires - time.monotonic()

    def _count_done(self, lease: _Lease, num_consumers: int) -> None:
        lease.consumers_expected = max(1, num_consumers)
        lease.consumers_done += 1

    @staticmethod
    def _remember(table: OrderedDict, key: str, value: object) -> None:  # type: ignore[type-arg]
        table[key] = value
        while len(table) > _MAX_REMEMBERED:
            table.popitem(last=False)

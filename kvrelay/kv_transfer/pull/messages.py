"""D's side-channel messages to P's ranks during a pull, sent on the peer threads (one per P
rank, side_channel.PeerThread): the handshake, the pin, the heartbeats and a release. Each posts
what P answered to the puller's event queue, which the engine thread drains (puller.py).
"""

from __future__ import annotations

import logging
import queue
import time
from typing import TYPE_CHECKING

from kvrelay.kv_transfer.p2p.handshake import LocalIdentity, ask_handshake
from kvrelay.kv_transfer.pull.meta import (
    LEASE_PENDING,
    HeartbeatRequest,
    LeaseStatus,
    LeaseStatuses,
    PinRequest,
    PullSpec,
    ReleaseRequest,
)
from kvrelay.kv_transfer.pull.state import HeartbeatAnswered, Peer, PinAnswered, PullEvent
from kvrelay.kv_transfer.side_channel import SideChannelClient, SideChannelError, decode

if TYPE_CHECKING:
    from kvrelay.kv_transfer.p2p.settings import NixlConfig

logger = logging.getLogger(__name__)

_PIN_RETRY_S = (0.002, 0.005, 0.01, 0.02, 0.05)  # backoff while P has not registered the lease


class PullMessages:
    def __init__(self, identity: LocalIdentity, config: NixlConfig, events: queue.Queue[PullEvent]) -> None:
        self.identity = identity
        self.config = config
        self.events = events

    def handshake(self, client: SideChannelClient, peer: Peer) -> None:
        self.events.put(ask_handshake(client, peer, self.identity.engine_id, peer.engine_id,
                                      self.config.transfer_timeout_seconds))

    def pin(self, client: SideChannelClient, peer: Peer, spec: PullSpec, deadline: float,
            ranges: list[tuple[int, int]]) -> None:
        """Ask P to pin the lease (and send the blocks' checksums); ask again while P has not
        registered it yet, until the deadline."""
        request = PinRequest(request_id=spec.remote_request_id, lease_id=spec.lease_id,
                             block_ids=spec.remote_block_ids, prompt_digest=spec.prompt_digest,
                             want_checksums=self.config.verify_checksum, ranges=ranges)
        key = (spec.req_id, peer.p_rank)
        attempt = 0
        while True:
            sent_at = time.monotonic()
            try:
                reply = client.call("pin", request, max(0.0, deadline - sent_at))
            except SideChannelError as e:
                self.events.put(PinAnswered(peer, key, None, f"pin failed: {e}", sent_at, ""))
                return
            status: LeaseStatus = decode(reply.body, LeaseStatus)
            if status.state != LEASE_PENDING or time.monotonic() >= deadline or client.stop.is_set():
                self.events.put(PinAnswered(peer, key, status, None, sent_at, reply.sender))
                return
            time.sleep(_PIN_RETRY_S[min(attempt, len(_PIN_RETRY_S) - 1)])
            attempt += 1

    def heartbeat(self, client: SideChannelClient, peer: Peer) -> None:
        leases = peer.leases
        if not leases or peer.reply is None:
            return
        sent_at = time.monotonic()
        try:
            reply = client.call("heartbeat", HeartbeatRequest(leases=list(leases)),
                                min(5.0, peer.thread.heartbeat_s * 2))
        except SideChannelError as e:
            logger.warning("NixlConnector: heartbeat to engine %s failed: %s", peer.engine_id, e)
            return
        statuses = decode(reply.body, LeaseStatuses).statuses
        self.events.put(HeartbeatAnswered(peer, statuses, sent_at, reply.sender))

    @staticmethod
    def release(client: SideChannelClient, spec: PullSpec, num_consumers: int) -> None:
        try:
            client.call("release", ReleaseRequest(request_id=spec.remote_request_id, lease_id=spec.lease_id,
                                                  num_consumers=num_consumers), timeout_s=2.0)
        except SideChannelError as e:
            logger.info("NixlConnector: release of %s failed (its lease will expire): %s",
                        spec.remote_request_id, e)

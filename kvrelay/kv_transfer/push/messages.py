"""D's side-channel messages to P's ranks during a push, sent on the peer threads (one per P
rank, side_channel.PeerThread): the handshake, a registration, a decline (this rank will not
register), the heartbeats and a cancel. Each posts what P answered to the receiver's event
queue, which the engine thread drains (push/receiver.py).

NOTE: a peer thread sends a registration or heartbeat, and records when, under `send_lock`, and
never for a receive D gave up (`given_up`): D's wait-out bound starts from a real send.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from typing import TYPE_CHECKING

from kvrelay.kv_transfer.p2p.handshake import ask_handshake
from kvrelay.kv_transfer.push.meta import (
    PUSH_CANCELLING,
    PushCancel,
    PushHeartbeat,
    PushRecv,
    PushRegister,
    PushStatus,
    PushStatuses,
)
from kvrelay.kv_transfer.push.receiver_state import (
    CancelAnswered,
    PushHeartbeatAnswered,
    PushPeer,
    RankRecv,
    RecvEvent,
    RegisterAnswered,
)
from kvrelay.kv_transfer.side_channel import SideChannelClient, SideChannelError, decode

if TYPE_CHECKING:
    from kvrelay.kv_transfer.p2p.handshake import LocalIdentity
    from kvrelay.kv_transfer.p2p.settings import NixlConfig
    from kvrelay.kv_transfer.transport.base import KVTransport

logger = logging.getLogger(__name__)


class PushMessages:
    def __init__(self, identity: LocalIdentity, instance_id: str, config: NixlConfig, transport: KVTransport,
                 events: queue.Queue[RecvEvent]) -> None:
        self.identity = identity
        self.instance_id = instance_id
        self.config = config
        self.transport = transport
        self.events = events
        self.send_lock = threading.Lock()
        self.given_up: set[str] = set()  # registration ids

    def lease_bound(self) -> float:
        """The longest lease P may hold on one of our registrations from a renewal."""
        return self.config.heartbeat_seconds * 3

    def handshake(self, client: SideChannelClient, peer: PushPeer) -> None:
        self.events.put(ask_handshake(client, peer, self.identity.engine_id, "",
                                      self.config.transfer_timeout_seconds))

    def register(self, client: SideChannelClient, recv: RankRecv) -> None:
        spec, layout, me = recv.spec, self.identity.layout, self.identity
        ranges = None if recv.source.ranges is None else list(recv.source.ranges)
        body = PushRegister(
            transfer_id=spec.transfer_id, registration_id=recv.registration_id, engine_id=me.engine_id,
            instance_id=self.instance_id, backend=me.backend, agent_metadata=self.transport.agent_metadata(),
            layer_names=list(layout.layer_names), num_blocks=layout.num_blocks,
            block_bytes=layout.block_bytes,
            base_addresses=list(layout.base_addresses), device=layout.device, block_size=me.block_size,
            fingerprint_digest=me.fingerprint_digest, prompt_digest=spec.prompt_digest,
            num_prompt_tokens=spec.num_prompt_tokens, first_block=spec.first_block,
            block_ids=list(spec.local_block_ids), sent_at=time.time(), tp_size=me.tp_size, tp_rank=me.tp_rank,
            max_age_s=self.config.transfer_timeout_seconds, max_lease_s=self.lease_bound(), ranges=ranges,
            fingerprint=dict(me.fingerprint))
        with self.send_lock:
            if recv.registration_id in self.given_up:
                return
            recv.last_contact = max(recv.last_contact, time.monotonic())
            client.send("push_register", body)
        try:
            reply = client.receive(self.config.transfer_timeout_seconds)
            status, error, sender = decode(reply.body, PushStatus), None, reply.sender
        except SideChannelError as e:
            status, error, sender = None, f"registration failed: {e}", ""
        self.events.put(RegisterAnswered(recv, status, error, time.monotonic(), sender))

    def decline(self, client: SideChannelClient, spec: PushRecv) -> None:
        """Tell a P rank this rank will not register: it frees the request once nobody else will."""
        body = PushCancel(transfer_id=spec.transfer_id, registration_id=secrets.token_hex(12),
                          tp_size=self.identity.tp_size, tp_rank=self.identity.tp_rank)
        try:
            client.call("push_cancel", body, min(2.0, self.config.transfer_timeout_seconds))
        except SideChannelError as e:
            logger.info("NixlPushConnector: telling %s that %s needs nothing failed (its lease will "
                        "expire): %s", client.address, spec.transfer_id, e)

    def heartbeat(self, client: SideChannelClient, peer: PushPeer) -> None:
        with self.send_lock:
            refs = tuple(ref for ref in peer.refs if ref.registration_id not in self.given_up)
            if not refs or peer.reply is None:
                return
            sent_at = peer.last_beat_sent = time.monotonic()
            client.send("push_heartbeat", PushHeartbeat(refs=list(refs), sent_at=time.time(),
                                                        max_age_s=self.config.transfer_timeout_seconds))
        try:
            reply = client.receive(min(5.0, peer.thread.heartbeat_s * 2))
        except SideChannelError as e:
            logger.warning("NixlPushConnector: heartbeat to %s:%d failed: %s", peer.host, peer.port, e)
            return
        statuses = decode(reply.body, PushStatuses).statuses
        self.events.put(PushHeartbeatAnswered(peer, refs, statuses, sent_at, time.monotonic(), reply.sender))

    def cancel(self, client: SideChannelClient, recv: RankRecv) -> None:
        """Tell P to stop; ask again while its writes are in flight (bounded)."""
        body = PushCancel(transfer_id=recv.spec.transfer_id, registration_id=recv.registration_id,
                          tp_size=self.identity.tp_size, tp_rank=self.identity.tp_rank)
        deadline = time.monotonic() + self.config.transfer_timeout_seconds
        try:
            while True:
                reply = client.call("push_cancel", body, min(2.0, self.config.transfer_timeout_seconds))
                status = decode(reply.body, PushStatus)
                if status.state != PUSH_CANCELLING or time.monotonic() > deadline or client.stop.is_set():
                    self.events.put(CancelAnswered(recv, status, reply.sender))
                    return
                time.sleep(0.005)
        except SideChannelError as e:
            logger.info("NixlPushConnector: cancel of %s unanswered (%s); waiting out its lease",
                        recv.spec.transfer_id, e)

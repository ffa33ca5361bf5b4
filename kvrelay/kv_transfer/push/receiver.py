"""D's side of a push: register the blocks with the prefill instance, wait for its writes, verify.

A request first waits for the handshake with P's base port (rank 0's side channel, once per
P), which says P's tp_size; with it this rank computes its plan (nixl_tp.plan_reads): the P
ranks that hold its KV heads, and the byte ranges of each block each is to write (whole blocks
between equal sizes). It tells the P ranks nobody reads from (the ones the plan gives it) that
nobody will register, so they free at once; a full local hit tells every P rank it reads from.

Then one `RankRecv` per P rank it reads from, driven by the engine thread (`start`, `abort`,
`poll`); everything that waits on the network runs on one `PeerThread` per P rank (the pull's),
which posts results to a queue the engine thread drains. A receive moves through

    handshake (once per P rank: its mode, model and layout must match ours)  ->  register (P
    accepts the blocks and the plan's byte ranges: "waiting" for its request, or "writing")
    ->  waiting (heartbeats renew P's lease on the registration and report P's progress)  ->
    the notification of the completing write: checksums verified

and a failure on the way (mode, model or TP mismatch, refused registration, no progress within
transfer_timeout_seconds, P dead or restarted, a failed write, an abort) ends the receive
unsuccessfully. The request settles once, when every one of its receives did: finished_recving
when all of them finished, failed_recving (the failure counted once) when any failed, after
which the scheduler applies the failure policy; the first failure gives up the others. Before a
receive ends unsuccessfully, D makes sure no late write
can land in the blocks: the write guard (transports that see writes: TCP) stops admitting them
at once and D waits for the admitted ones; otherwise (NIXL) D waits for P's "cancelled" or, when P
does not answer, for the registration's lease to run out (its last renewal, plus the lease, plus
a write's time bound).

The checksums cover exactly the bytes a P rank writes: whole blocks, or its byte ranges of each
block, on both sides. Where D sees each write land (TCP), the write guard hands every landed
write to `_on_landed`, which takes that write's per-layer block sums at once (`security.LandedSums`), so
the completing write only combines them. One-sided transports (NIXL, Mooncake) write without D
knowing, but deliver each write's notification only once its bytes landed: there every earlier
write carries a `PushLanded` (its layers and prompt blocks), which `poll` sums the same way, and
the completing notification names its own range and how many `PushLanded` went out. When one is
missing (or a sum failed), D counts every layer of every block at the end instead.
"""

from __future__ import annotations

import functools
import logging
import queue
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import zmq

from kvrelay.kv_transfer.p2p import security
from kvrelay.kv_transfer.p2p.handshake import HandshakeAnswered, LocalIdentity
from kvrelay.kv_transfer.p2p.results import LoadResults
from kvrelay.kv_transfer.p2p.tp_plan import plan_reads
from kvrelay.kv_transfer.push.guard import BlockGuard
from kvrelay.kv_transfer.push.messages import PushMessages
from kvrelay.kv_transfer.push.meta import (
    PUSH_CANCELLED,
    PUSH_REFUSED,
    PUSH_WAITING,
    PUSH_WRITING,
    PUSH_WRITTEN,
    PushLanded,
    PushNotification,
    PushRecv,
    PushRef,
    PushStatus,
)
from kvrelay.kv_transfer.push.receiver_state import (
    CancelAnswered,
    Planning,
    PushHeartbeatAnswered,
    PushPeer,
    RankRecv,
    RecvEvent,
    RecvStage,
    RegisterAnswered,
    RequestRecvs,
    handshake_problem,
)
from kvrelay.kv_transfer.side_channel import (
    PeerThread,
)
from kvrelay.kv_transfer.wakeup import WakingQueue

if TYPE_CHECKING:
    import torch

    from kvrelay.kv_transfer.p2p.settings import NixlConfig
    from kvrelay.kv_transfer.transport.base import KVTransport

logger = logging.getLogger(__name__)


class PushReceiver:
    def __init__(self, transport: KVTransport, identity: LocalIdentity, instance_id: str,
                 config: NixlConfig, channel_key: bytes, kv_layers: Sequence[torch.Tensor]) -> None:
        self.transport = transport
        self.identity = identity
        self.instance_id = instance_id
        self.config = config
        self.channel_key = channel_key
        self.kv_layers = list(kv_layers)
        self.sees_writes = transport.sees_writes  # NOTE: its guard refuses stray writes itself
        self.guard = BlockGuard(self._on_landed if self.sees_writes else None)
        transport.set_write_guard(self.guard)
        self._ctx = zmq.Context()
        self._peers: dict[tuple[str, int], PushPeer] = {}
        self._planning: dict[str, Planning] = {}  # by request id
        self._recvs: dict[tuple[str, int], RankRecv] = {}  # by (request id, P rank)
        self._requests: dict[str, RequestRecvs] = {}
        self._by_registration: dict[str, RankRecv] = {}
        self._events: queue.Queue[RecvEvent] = WakingQueue()
        self._results = LoadResults()
        self._closing: list[PeerThread] = []
        self._messages = PushMessages(identity, instance_id, config, transport, self._events)

    def has_pending(self) -> bool:
        return bool(self._recvs or self._planning)

    # ---------------------------------------------------------------- engine thread: intake

    def start(self, spec: PushRecv) -> None:
        if spec.rejected is not None:
            self._results.count("params_rejected")
            self._fail_now(spec.req_id, f"refused its kv_transfer_params: {spec.rejected}")
            return
        # NOTE: P's rank 0 listens on remote_port: its handshake says P's tp_size, so the plan.
        base = self._peer_for(spec.remote_host, spec.remote_port, 0)
        if base.reply is not None:
            self._plan(spec, base.reply.tp_size)
            return
        self._planning[spec.req_id] = Planning(spec, base.address,
                                               time.monotonic() + self.config.transfer_timeout_seconds)

    def _plan(self, spec: PushRecv, p_tp: int) -> None:
        """Register with every P rank that holds our KV heads; tell the ones nobody reads from."""
        me = self.identity
        plan = plan_reads(me.num_kv_heads, p_tp, me.tp_size, me.tp_rank, me.head_bytes)
        for source in plan.releases:
            self._decline(spec, source.p_rank)
        if spec.notify_only:  # a full local hit: nothing to write, P may free the blocks
            for source in plan.reads:
                self._decline(spec, source.p_rank)
            return
        self._requests[spec.req_id] = RequestRecvs(spec, pending=len(plan.reads))
        deadline = time.monotonic() + self.config.transfer_timeout_seconds
        for source in plan.reads:
            recv = RankRecv(spec, source, spec.remote_port + source.p_rank, secrets.token_hex(12), deadline)
            if self.config.verify_checksum:
                recv.landed = security.LandedSums(self.kv_layers, spec.local_block_ids, recv.local_ranges)
            self._recvs[recv.key] = recv
            self._by_registration[recv.registration_id] = recv
            self.guard.open(recv.registration_id, spec.local_block_ids, recv.local_ranges)
            peer = self._peer_for(spec.remote_host, recv.port, source.p_rank)
            if peer.reply is not None:
                self._register(peer, recv)

    def _decline(self, spec: PushRecv, p_rank: int) -> None:
        peer = self._peer_for(spec.remote_host, spec.remote_port + p_rank, p_rank)
        peer.thread.submit(functools.partial(self._messages.decline, spec=spec))

    def abort(self, req_id: str) -> None:
        planning = self._planning.get(req_id)
        if planning is not None and not planning.spec.notify_only:
            # NOTE: nothing registered, so nothing can land: settled now; once P's size is known,
            # its ranks hear that this rank will not register, so they free at once
            planning.spec = msgspec.structs.replace(planning.spec, notify_only=True)
            self._results.failed.add(req_id)
            return
        for recv in [r for r in self._recvs.values() if r.spec.req_id == req_id]:
            recv.aborted = True
            self._give_up(recv, "aborted while its KV was being pushed", count=False)

    def _peer_for(self, host: str, port: int, p_rank: int) -> PushPeer:
        peer = self._peers.get((host, port))
        if peer is None:
            beats: list[PushPeer] = []  # NOTE: the thread needs its peer, the peer its thread
            thread = PeerThread(self._ctx, host, port, self.channel_key, name=f"kv-push-peer-{port}",
                                heartbeat=lambda client: self._messages.heartbeat(client, beats[0]),
                                heartbeat_s=self.config.heartbeat_seconds)
            peer = PushPeer(host, port, p_rank, thread)
            beats.append(peer)
            self._peers[(host, port)] = peer
            thread.submit(functools.partial(self._messages.handshake, peer=peer))
        return peer

    # ---------------------------------------------------------------- engine thread: progress

    def poll(self) -> LoadResults:
        """Advance every receive; return what settled since the last call."""
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            match event:
                case HandshakeAnswered():
                    self._on_handshake(event)
                case RegisterAnswered():
                    self._on_register(event)
                case PushHeartbeatAnswered():
                    self._on_heartbeat(event)
                case CancelAnswered():
                    self._on_cancel(event)
        for raw in self.transport.get_notifications():
            self._on_notification(raw)
        now = time.monotonic()
        for planning in [p for p in self._planning.values() if now >= p.deadline]:
            if not planning.spec.notify_only:  # NOTE: a full hit's (or an abort's) notice only
                self._results.count("timeouts")
            self._fail_planning(planning, "got no handshake from the prefill instance in time")
        timeout = self.config.transfer_timeout_seconds
        for recv in list(self._recvs.values()):
            if recv.stage == RecvStage.CANCELLING:
                self._check_cancelled(recv, now)
            elif now >= recv.deadline:
                self._results.count("timeouts")
                self._give_up(recv, f"saw no progress from P rank {recv.source.p_rank} for {timeout:.1f} s "
                                    f"(in the {recv.stage} stage){recv.never_started()}")
        for peer in self._peers.values():
            peer.refs = tuple(PushRef(r.spec.transfer_id, r.registration_id) for r in self._recvs.values()
                              if r.address == peer.address and r.stage == RecvStage.WAITING)
        results, self._results = self._results, LoadResults()
        return results

    def _on_handshake(self, event: HandshakeAnswered[PushPeer]) -> None:
        peer, reply, error = event.peer, event.reply, event.error
        if self._peers.get(peer.address) is not peer:
            return
        if reply is not None and error is None:
            base = self._peers.get((peer.host, peer.port - peer.p_rank))
            base_tp = base.reply.tp_size if base is not None and base.reply is not None else reply.tp_size
            error = handshake_problem(self.identity, peer, reply, base_tp)
            if error is not None:
                self._results.count("handshakes_incompatible")
        if error is not None:
            self._drop_peer(peer, error)
            return
        assert reply is not None
        peer.reply = reply
        peer.thread.heartbeat_s = min(self.config.heartbeat_seconds, reply.lease_seconds / 3)
        for planning in [p for p in self._planning.values() if p.base == peer.address]:
            del self._planning[planning.spec.req_id]
            self._plan(planning.spec, reply.tp_size)
        for recv in list(self._recvs.values()):
            if recv.address == peer.address and recv.stage == RecvStage.HANDSHAKE:
                self._register(peer, recv)

    def _register(self, peer: PushPeer, recv: RankRecv) -> None:
        recv.stage, recv.contacted = RecvStage.REGISTER, True
        peer.thread.submit(functools.partial(self._messages.register, recv=recv))

    def _on_register(self, event: RegisterAnswered) -> None:
        recv, status, received_at = event.recv, event.status, event.received_at
        if self._recvs.get(recv.key) is not recv or recv.stage != RecvStage.REGISTER:
            return
        peer = self._peer_of(recv)
        if status is not None and peer is not None and not self._same_instance(peer, event.sender):
            return
        if status is None or status.state not in (PUSH_WAITING, PUSH_WRITING, PUSH_WRITTEN):
            why = event.error or f"P answered {status.state!r}: {status.error}"  # type: ignore[union-attr]
            recv.safe = status is not None and status.state == PUSH_REFUSED  # nothing was accepted
            self._give_up(recv, f"its push registration with P rank {recv.source.p_rank} failed: {why}")
            return
        recv.stage, recv.lease_s, recv.last_contact = RecvStage.WAITING, status.lease_s, received_at
        if peer is not None and status.lease_s > 0:
            peer.thread.heartbeat_s = min(peer.thread.heartbeat_s, status.lease_s / 3)
        self._progress(recv, status, received_at)

    def _on_heartbeat(self, event: PushHeartbeatAnswered) -> None:
        peer, received_at = event.peer, event.received_at
        if self._peers.get(peer.address) is not peer or not self._same_instance(peer, event.sender):
            return
        by_id = {ref.transfer_id: self._by_registration.get(ref.registration_id) for ref in event.refs}
        for status in event.statuses:
            recv = by_id.get(status.transfer_id)
            if recv is None or recv.stage != RecvStage.WAITING:
                continue
            recv.last_contact = max(recv.last_contact, received_at)
            if status.state in (PUSH_WAITING, PUSH_WRITING, PUSH_WRITTEN):
                self._progress(recv, status, received_at)
            else:
                recv.safe = status.state in (PUSH_REFUSED, PUSH_CANCELLED)
                self._give_up(recv, f"P rank {recv.source.p_rank} stopped the push ({status.state}): "
                                    f"{status.error}{recv.never_started()}")

    def _progress(self, recv: RankRecv, status: PushStatus, now: float) -> None:
        """P computed another layer (or sent the completing write): D waits another timeout."""
        if status.state == PUSH_WAITING:
            return
        written = status.state == PUSH_WRITTEN
        if status.layers_computed > recv.progress or (written and not recv.written_seen):
            recv.progress = max(recv.progress, status.layers_computed)
            recv.written_seen = recv.written_seen or written
            recv.deadline = now + self.config.transfer_timeout_seconds

    def _on_cancel(self, event: CancelAnswered) -> None:
        recv = event.recv
        peer = self._peer_of(recv)
        if self._recvs.get(recv.key) is not recv:
            return
        if peer is not None and not self._same_instance(peer, event.sender):
            return
        if event.status.state == PUSH_CANCELLED:
            recv.safe = True

    def _same_instance(self, peer: PushPeer, sender: str) -> bool:
        """False (and every receive from the peer failed) when P restarted since the handshake:
        the old process is gone, so it writes nothing more."""
        if peer.reply is None or sender == peer.reply.instance_id:
            return True
        for recv in self._recvs.values():
            if recv.address == peer.address:
                recv.safe = True
        self._drop_peer(peer, f"the prefill instance at {peer.host}:{peer.port} restarted")
        return False

    def _peer_of(self, recv: RankRecv) -> PushPeer | None:
        return self._peers.get(recv.address)

    # ---------------------------------------------------------------- completion

    def _on_notification(self, raw: bytes) -> None:
        landed = PushLanded.decode(raw)
        if landed is not None:
            recv = self._live_recv(landed.transfer_id, landed.registration_id)
            if recv is not None and recv.stage != RecvStage.CANCELLING and not self.sees_writes:
                recv.num_landed += 1
                recv.record_landed(landed, len(self.kv_layers))
            return  # NOTE: where D sees writes (TCP) the guard recorded this write already
        note = PushNotification.decode(raw)
        recv = self._live_recv(note.transfer_id, note.registration_id) if note is not None else None
        if note is None or recv is None:
            return  # a notification for a receive that ended
        if recv.stage == RecvStage.CANCELLING:  # every write of P's had finished: the blocks are safe
            recv.safe = True
            return
        if not self.sees_writes:
            if note.landed is not None:
                recv.record_landed(note.landed, len(self.kv_layers))
            if recv.num_landed != note.num_landed:  # one went missing or came after this one
                recv.landed = None
        self._finish(recv, note.checksums)

    def _live_recv(self, transfer_id: str, registration_id: str) -> RankRecv | None:
        recv = self._by_registration.get(registration_id)
        return recv if recv is not None and recv.spec.transfer_id == transfer_id else None

    def _finish(self, recv: RankRecv, checksums: list[int]) -> None:
        """P rank's completing write arrived: verify exactly the bytes it wrote."""
        spec = recv.spec
        self._forget(recv)
        ranges = recv.source.ranges
        per_block = self.identity.layout.block_bytes if ranges is None else sum(r.length for r in ranges)
        self._results.count("bytes_loaded", len(spec.local_block_ids) * per_block * len(self.kv_layers))
        request = self._requests[spec.req_id]
        if not recv.aborted and self.config.verify_checksum:
            # NOTE: where D heard every write land, their sums were taken then: only combining is left
            local = recv.landed.digests() if recv.landed is not None else None
            if local is None:
                local = security.block_digests(self.kv_layers, spec.local_block_ids, recv.local_ranges)
            bad = list(spec.local_block_ids)  # NOTE: all of them when P sent no checksum per block
            if len(checksums) == len(local):
                pairs = zip(spec.local_block_ids, local, checksums, strict=True)
                bad = [b for b, got, want in pairs if got != want]
            if bad:
                logger.warning("NixlPushConnector: request %s: %d of %d blocks pushed by P rank %d failed "
                               "their checksum; recovering per kv_load_failure_policy", spec.req_id, len(bad),
                               len(local), recv.source.p_rank)
                request.invalid_block_ids.update(bad)
        self._settle(recv, failed=False)

    def _settle(self, recv: RankRecv, failed: bool) -> None:
        """One of a request's receives ended; report the request when it was the last."""
        req_id = recv.spec.req_id
        request = self._requests[req_id]
        request.pending -= 1
        request.count_failure = request.count_failure or (failed and recv.count_failure and not recv.aborted)
        if failed and not request.failed:
            request.failed = True
            for sibling in [r for r in self._recvs.values() if r.spec.req_id == req_id]:
                self._give_up(sibling, f"gave up: its push from P rank {recv.source.p_rank} failed",
                              count=False)
        if request.pending > 0 or self._requests.get(req_id) is not request:
            return
        del self._requests[req_id]
        results = self._results
        if request.failed:
            if request.count_failure:
                results.count("load_failures")
            results.failed.add(req_id)
            return
        results.finished.add(req_id)
        results.count("tokens_loaded", len(recv.spec.local_block_ids) * self.identity.block_size)
        results.count("seconds_loading", time.monotonic() - request.started)
        if request.invalid_block_ids:
            results.invalid_block_ids.update(request.invalid_block_ids)
            results.count("checksum_failures")
            results.count("load_failures")

    def _on_landed(self, registration_id: str, block_ids: Sequence[int], layers: Sequence[int]) -> None:
        """A transport thread: a write for the registration landed; take its checksum sums now."""
        recv = self._by_registration.get(registration_id)
        if recv is not None:
            recv.record_writes(block_ids, layers)

    # ---------------------------------------------------------------- failures

    def _give_up(self, recv: RankRecv, reason: str, count: bool = True) -> None:
        """Stop the receive. Its failure is reported once no write of P's can land any more."""
        if recv.stage == RecvStage.CANCELLING:
            return
        recv.stage, recv.failure = RecvStage.CANCELLING, reason
        recv.count_failure = recv.count_failure and count
        self.guard.close(recv.registration_id)
        with self._messages.send_lock:  # from here on no registration or heartbeat for it leaves
            self._messages.given_up.add(recv.registration_id)
        peer = self._peer_of(recv)
        if not recv.contacted:
            recv.safe = True
        if not recv.safe:
            # NOTE: P takes no registration or heartbeat older than the timeout, renews the lease
            # by at most the lease from when it read one, and starts no write after that; a write
            # it started ends within the timeout (the transport's bound).
            # The age and lease bounds are ours (the registration states them); the write bound
            # is the longer of the two instances' timeouts.
            timeout = self.config.transfer_timeout_seconds
            reply = peer.reply if peer is not None else None
            theirs = reply.transfer_timeout_seconds if reply is not None else 0.0
            lease = max(recv.lease_s, self._messages.lease_bound())
            last = max(recv.last_contact, peer.last_beat_sent if peer is not None else 0.0)
            recv.safe_after = last + timeout + lease + max(timeout, theirs)
        if peer is not None:  # NOTE: also before registering, so P frees the request at once
            peer.thread.submit(functools.partial(self._messages.cancel, recv=recv))
        self._check_cancelled(recv, time.monotonic())

    def _check_cancelled(self, recv: RankRecv, now: float) -> None:
        admitted = self.guard.in_flight(recv.registration_id)
        if self.sees_writes and admitted == 0:
            recv.safe = True  # NOTE: the guard admits nothing more for it, and nothing is landing
        if not recv.safe and now < recv.safe_after:
            return
        if not recv.safe:
            logger.warning("NixlPushConnector: request %s: P rank %d never confirmed the cancel; its lease "
                           "on the registration has run out", recv.spec.req_id, recv.source.p_rank)
        self._forget(recv)
        if recv.count_failure and not recv.aborted:
            logger.warning("NixlPushConnector: request %s %s; recovering per kv_load_failure_policy",
                           recv.spec.req_id, recv.failure)
        self._settle(recv, failed=True)

    def _forget(self, recv: RankRecv) -> None:
        self.guard.close(recv.registration_id)
        with self._messages.send_lock:
            self._messages.given_up.discard(recv.registration_id)
        self._recvs.pop(recv.key, None)
        self._by_registration.pop(recv.registration_id, None)

    def _fail_now(self, req_id: str, reason: str) -> None:
        logger.warning("NixlPushConnector: request %s %s; recovering per kv_load_failure_policy",
                       req_id, reason)
        self._results.count("load_failures")
        self._results.failed.add(req_id)

    def _fail_planning(self, planning: Planning, reason: str) -> None:
        del self._planning[planning.spec.req_id]
        if not planning.spec.notify_only:  # NOTE: nobody waits for a full hit's (or an abort's) notice
            self._fail_now(planning.spec.req_id, reason)

    def _drop_peer(self, peer: PushPeer, reason: str) -> None:
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
        peer.thread.close(timeout_s=0.0)
        self._closing.append(peer.thread)
        for planning in [p for p in self._planning.values() if p.base == peer.address]:
            self._fail_planning(planning, reason)
        for recv in list(self._recvs.values()):
            if recv.address == peer.address:
                self._give_up(recv, reason)

    def close(self) -> None:
        self._recvs.clear()
        self._planning.clear()
        self._requests.clear()
        self._by_registration.clear()
        self.transport.set_write_guard(None)
        threads = [peer.thread for peer in self._peers.values()] + self._closing
        self._peers.clear()
        for thread in threads:
            thread.close()
        self._closing = []
        self._ctx.term()

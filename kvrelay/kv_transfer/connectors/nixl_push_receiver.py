"""D's side of a push: register the blocks with the prefill instance, wait for its writes, verify.

One `_Recv` per request, driven by the engine thread (`start`, `abort`, `poll`); everything that
waits on the network runs on one `PeerThread` per prefill instance (the pull's), which posts
results to a queue the engine thread drains. A receive moves through

    handshake (once per P: its mode, model and layout must match ours)  ->  register (P
    accepts the blocks: "waiting" for its request, or "writing")  ->  waiting (heartbeats
    renew P's lease on the registration and report P's progress)  ->  the notification of
    the completing write: checksums verified -> finished_recving

and a failure on the way (mode or model mismatch, refused registration, no progress within
transfer_timeout_seconds, P dead or restarted, a failed write, an abort) ends in failed_recving,
after which the scheduler applies the failure policy. Before that, D makes sure no late write
can land in the blocks: the write guard (transports that see writes: TCP) stops admitting them
at once and D waits for the admitted ones; otherwise (NIXL) D waits for P's "cancelled" or, when P
does not answer, for the registration's lease to run out (its last renewal, plus the lease, plus
a write's time bound).

The checksums: where D sees each write land (TCP), the write guard hands every landed write to
`_on_landed`, which takes that write's per-layer block sums at once (`security.LandedSums`), so
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
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from kvrelay.kv_transfer.connectors import security
from kvrelay.kv_transfer.connectors.nixl_meta import HandshakeReply, HandshakeRequest
from kvrelay.kv_transfer.connectors.nixl_pull import LocalIdentity, PullResults
from kvrelay.kv_transfer.connectors.nixl_push_guard import BlockGuard
from kvrelay.kv_transfer.connectors.nixl_push_meta import (
    PUSH_CANCELLED,
    PUSH_CANCELLING,
    PUSH_REFUSED,
    PUSH_WAITING,
    PUSH_WRITING,
    PUSH_WRITTEN,
    PushHeartbeat,
    PushLanded,
    PushNotification,
    PushRecv,
    PushRef,
    PushRegister,
    PushStatus,
    PushStatuses,
)
from kvrelay.kv_transfer.connectors.side_channel import (
    PeerThread,
    SideChannelClient,
    SideChannelError,
    decode,
)

if TYPE_CHECKING:
    import torch

    from kvrelay.kv_transfer.connectors.nixl import NixlConfig
    from kvrelay.kv_transfer.transport.base import KVTransport

logger = logging.getLogger(__name__)


@dataclass
class _Peer:
    host: str
    port: int
    thread: PeerThread
    reply: HandshakeReply | None = None
    refs: tuple[PushRef, ...] = ()  # what the heartbeats renew (read by the peer thread)
    last_beat_sent: float = 0.0  # monotonic, written by the peer thread


@dataclass
class _Recv:
    spec: PushRecv
    registration_id: str
    deadline: float  # monotonic: fail unless P made progress by then
    state: str = "handshake"  # -> "register" -> "waiting" (-> "cancelling": given up)
    contacted: bool = False  # a registration went out: P may write until told otherwise
    last_contact: float = 0.0  # when P last (possibly) renewed its lease, by our clock
    lease_s: float = 0.0
    progress: int = -1
    written_seen: bool = False
    started: float = 0.0
    safe: bool = False  # P confirmed no write is or will be in flight
    safe_after: float = float("inf")
    aborted: bool = False
    failure: str = ""
    landed: security.LandedSums | None = None  # checksum sums of the writes as they land
    num_landed: int = 0  # PushLanded notifications recorded (one-sided transports)


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
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._recvs: dict[str, _Recv] = {}
        self._by_registration: dict[str, _Recv] = {}
        self._events: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._results = PullResults()
        self._closing: list[PeerThread] = []
        # NOTE: a peer thread sends a registration or heartbeat, and records when, under this
        # lock, and never for a receive D gave up: D's wait-out bound starts from a real send.
        self._send_lock = threading.Lock()
        self._given_up: set[str] = set()  # registration ids

    def has_pending(self) -> bool:
        return bool(self._recvs)

    # ---------------------------------------------------------------- engine thread: intake

    def start(self, spec: PushRecv) -> None:
        if spec.rejected is not None:
            self._results.count("params_rejected")
            self._fail_now(spec.req_id, f"refused its kv_transfer_params: {spec.rejected}")
            return
        # NOTE: P's rank r listens on remote_port + r and pushes this rank's heads only.
        spec = msgspec.structs.replace(spec, remote_port=spec.remote_port + self.identity.tp_rank)
        peer = self._peer_for(spec.remote_host, spec.remote_port)
        now = time.monotonic()
        recv = _Recv(spec, secrets.token_hex(12), deadline=now + self.config.transfer_timeout_seconds,
                     started=now)
        if spec.notify_only:  # a full local hit: register nothing, so P frees at once
            peer.thread.submit(functools.partial(self._register_job, recv=recv, reply_event=False))
            return
        if self.config.verify_checksum:
            recv.landed = security.LandedSums(self.kv_layers, spec.local_block_ids)
        self._recvs[spec.req_id] = recv
        self._by_registration[recv.registration_id] = recv
        self.guard.open(recv.registration_id, spec.local_block_ids)
        if peer.reply is not None:
            self._register(peer, recv)

    def abort(self, req_id: str) -> None:
        recv = self._recvs.get(req_id)
        if recv is not None:
            recv.aborted = True
            self._give_up(recv, "aborted while its KV was being pushed")

    def _peer_for(self, host: str, port: int) -> _Peer:
        peer = self._peers.get((host, port))
        if peer is None:
            beats: list[_Peer] = []  # NOTE: the thread needs its peer, the peer its thread
            thread = PeerThread(self._ctx, host, port, self.channel_key, name=f"kv-push-peer-{port}",
                                heartbeat=lambda client: self._heartbeat_job(client, beats[0]),
                                heartbeat_s=self.config.heartbeat_seconds)
            peer = _Peer(host, port, thread)
            beats.append(peer)
            self._peers[(host, port)] = peer
            thread.submit(functools.partial(self._handshake_job, peer=peer))
        return peer

    # ---------------------------------------------------------------- peer threads: jobs

    def _handshake_job(self, client: SideChannelClient, peer: _Peer) -> None:
        request = HandshakeRequest(engine_id=self.identity.engine_id, expected_engine_id="")
        try:
            reply = client.call("handshake", request, self.config.transfer_timeout_seconds)
            self._events.put(("handshake", peer, decode(reply.body, HandshakeReply), None))
        except SideChannelError as e:
            self._events.put(("handshake", peer, None, f"handshake with {client.address} failed: {e}"))

    def _register_job(self, client: SideChannelClient, recv: _Recv, reply_event: bool = True) -> None:
        spec, layout, me = recv.spec, self.identity.layout, self.identity
        body = PushRegister(
            transfer_id=spec.transfer_id, registration_id=recv.registration_id, engine_id=me.engine_id,
            instance_id=self.instance_id, backend=me.backend, agent_metadata=self.transport.agent_metadata(),
            layer_names=list(layout.layer_names), num_blocks=layout.num_blocks,
            block_bytes=layout.block_bytes,
            base_addresses=list(layout.base_addresses), device=layout.device, block_size=me.block_size,
            fingerprint_digest=me.fingerprint_digest, prompt_digest=spec.prompt_digest,
            num_prompt_tokens=spec.num_prompt_tokens, first_block=spec.first_block,
            block_ids=list(spec.local_block_ids), sent_at=time.time(), tp_size=me.tp_size, tp_rank=me.tp_rank,
            max_age_s=self.config.transfer_timeout_seconds, max_lease_s=self._lease_bound())
        with self._send_lock:
            if recv.registration_id in self._given_up:
                return
            recv.last_contact = max(recv.last_contact, time.monotonic())
            client.send("push_register", body)
        try:
            reply = client.receive(self.config.transfer_timeout_seconds)
            status, error, sender = decode(reply.body, PushStatus), None, reply.sender
        except SideChannelError as e:
            status, error, sender = None, f"registration failed: {e}", ""
        if reply_event:
            self._events.put(("register", recv, status, error, time.monotonic(), sender))

    def _heartbeat_job(self, client: SideChannelClient, peer: _Peer) -> None:
        with self._send_lock:
            refs = tuple(ref for ref in peer.refs if ref.registration_id not in self._given_up)
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
        self._events.put(("heartbeat", peer, refs, statuses, sent_at, time.monotonic(), reply.sender))

    def _cancel_job(self, client: SideChannelClient, recv: _Recv) -> None:
        """Tell P to stop; ask again while its writes are in flight (bounded)."""
        ref = PushRef(recv.spec.transfer_id, recv.registration_id)
        deadline = time.monotonic() + self.config.transfer_timeout_seconds
        try:
            while True:
                reply = client.call("push_cancel", ref, min(2.0, self.config.transfer_timeout_seconds))
                status = decode(reply.body, PushStatus)
                if status.state != PUSH_CANCELLING or time.monotonic() > deadline or client.stop.is_set():
                    self._events.put(("cancel", recv, status, reply.sender))
                    return
                time.sleep(0.005)
        except SideChannelError as e:
            logger.info("NixlPushConnector: cancel of %s unanswered (%s); waiting out its lease",
                        recv.spec.transfer_id, e)

    # ---------------------------------------------------------------- engine thread: progress

    def poll(self) -> PullResults:
        """Advance every receive; return what settled since the last call."""
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            getattr(self, f"_on_{event[0]}")(*event[1:])
        for raw in self.transport.get_notifications():
            self._on_notification(raw)
        now = time.monotonic()
        for recv in list(self._recvs.values()):
            if recv.state == "cancelling":
                self._check_cancelled(recv, now)
            elif now >= recv.deadline:
                self._results.count("timeouts")
                timeout = self.config.transfer_timeout_seconds
                self._give_up(recv, f"saw no progress from the prefill instance for {timeout:.1f} s "
                                    f"(in the {recv.state} stage)")
        for peer in self._peers.values():
            peer.refs = tuple(PushRef(r.spec.transfer_id, r.registration_id) for r in self._recvs.values()
                              if (r.spec.remote_host, r.spec.remote_port) == (peer.host, peer.port)
                              and r.state == "waiting")
        results, self._results = self._results, PullResults()
        return results

    def _on_handshake(self, peer: _Peer, reply: HandshakeReply | None, error: str | None) -> None:
        if self._peers.get((peer.host, peer.port)) is not peer:
            return
        if reply is not None and error is None:
            error = self._incompatibility(peer, reply)
        if error is not None:
            self._drop_peer(peer, error)
            return
        assert reply is not None
        peer.reply = reply
        peer.thread.heartbeat_s = min(self.config.heartbeat_seconds, reply.lease_seconds / 3)
        for recv in list(self._recvs.values()):
            if self._peer_of(recv) is peer and recv.state == "handshake":
                self._register(peer, recv)

    def _incompatibility(self, peer: _Peer, reply: HandshakeReply) -> str | None:
        me = self.identity
        where = f"the prefill instance at {peer.host}:{peer.port} (engine {reply.engine_id})"
        mode = getattr(reply, "transfer_mode", "pull")
        if mode != "push":
            return (f"{where} runs transfer_mode {mode!r} (NixlConnector) and this decode instance "
                    "'push' (NixlPushConnector): run both with the same kv_connector")
        # NOTE: before the fingerprint, which covers the TP mapping and would hide the reason
        if reply.tp_size != me.tp_size:
            return (f"{where} runs tensor_parallel_size {reply.tp_size} and this decode instance "
                    f"{me.tp_size}: NixlPushConnector pushes between equal sizes only (rank r to rank r); "
                    "configure both instances with the same tensor_parallel_size")
        if reply.fingerprint_digest != me.fingerprint_digest:
            return f"{where} runs another model or KV format ({reply.fingerprint}, ours {me.fingerprint})"
        mismatches = [(name, theirs, ours) for name, theirs, ours in (
            ("backend", reply.backend, me.backend), ("block_size", reply.block_size, me.block_size),
            ("num_layers", len(reply.layer_names), len(me.layout.layer_names)),
            ("block_bytes", reply.block_bytes, me.layout.block_bytes), ("tp_rank", reply.tp_rank, me.tp_rank))
            if theirs != ours]
        if mismatches:
            text = ", ".join(f"{name}: theirs {theirs!r}, ours {ours!r}" for name, theirs, ours in mismatches)
            return f"{where} has an incompatible KV layout ({text}); configure both instances alike"
        return None

    def _register(self, peer: _Peer, recv: _Recv) -> None:
        recv.state, recv.contacted = "register", True
        peer.thread.submit(functools.partial(self._register_job, recv=recv))

    def _on_register(self, recv: _Recv, status: PushStatus | None, error: str | None,
                     received_at: float, sender: str) -> None:
        if self._recvs.get(recv.spec.req_id) is not recv or recv.state != "register":
            return
        peer = self._peer_of(recv)
        if status is not None and peer is not None and not self._same_instance(peer, sender):
            return
        if status is None or status.state not in (PUSH_WAITING, PUSH_WRITING, PUSH_WRITTEN):
            why = error or f"P answered {status.state!r}: {status.error}"  # type: ignore[union-attr]
            recv.safe = status is not None and status.state == PUSH_REFUSED  # nothing was accepted
            self._give_up(recv, f"its push registration failed: {why}")
            return
        recv.state, recv.lease_s, recv.last_contact = "waiting", status.lease_s, received_at
        if peer is not None and status.lease_s > 0:
            peer.thread.heartbeat_s = min(peer.thread.heartbeat_s, status.lease_s / 3)
        self._progress(recv, status, received_at)

    def _on_heartbeat(self, peer: _Peer, refs: tuple[PushRef, ...], statuses: list[PushStatus],
                      sent_at: float, received_at: float, sender: str) -> None:
        if self._peers.get((peer.host, peer.port)) is not peer or not self._same_instance(peer, sender):
            return
        by_id = {ref.transfer_id: self._by_registration.get(ref.registration_id) for ref in refs}
        for status in statuses:
            recv = by_id.get(status.transfer_id)
            if recv is None or recv.state != "waiting":
                continue
            recv.last_contact = max(recv.last_contact, received_at)
            if status.state in (PUSH_WAITING, PUSH_WRITING, PUSH_WRITTEN):
                self._progress(recv, status, received_at)
            else:
                recv.safe = status.state in (PUSH_REFUSED, PUSH_CANCELLED)
                self._give_up(recv, f"the prefill instance stopped the push ({status.state}): {status.error}")

    def _progress(self, recv: _Recv, status: PushStatus, now: float) -> None:
        """P computed another layer (or sent the completing write): D waits another timeout."""
        if status.state == PUSH_WAITING:
            return
        written = status.state == PUSH_WRITTEN
        if status.layers_computed > recv.progress or (written and not recv.written_seen):
            recv.progress = max(recv.progress, status.layers_computed)
            recv.written_seen = recv.written_seen or written
            recv.deadline = now + self.config.transfer_timeout_seconds

    def _on_cancel(self, recv: _Recv, status: PushStatus, sender: str) -> None:
        peer = self._peer_of(recv)
        if self._recvs.get(recv.spec.req_id) is not recv:
            return
        if peer is not None and not self._same_instance(peer, sender):
            return
        if status.state == PUSH_CANCELLED:
            recv.safe = True

    def _same_instance(self, peer: _Peer, sender: str) -> bool:
        """False (and every receive from the peer failed) when P restarted since the handshake:
        the old process is gone, so it writes nothing more."""
        if peer.reply is None or sender == peer.reply.instance_id:
            return True
        for recv in self._recvs.values():
            if self._peer_of(recv) is peer:
                recv.safe = True
        self._drop_peer(peer, f"the prefill instance at {peer.host}:{peer.port} restarted")
        return False

    def _peer_of(self, recv: _Recv) -> _Peer | None:
        return self._peers.get((recv.spec.remote_host, recv.spec.remote_port))

    # ---------------------------------------------------------------- completion

    def _on_notification(self, raw: bytes) -> None:
        landed = PushLanded.decode(raw)
        if landed is not None:
            recv = self._live_recv(landed.transfer_id, landed.registration_id)
            if recv is not None and recv.state != "cancelling" and not self.sees_writes:
                recv.num_landed += 1
                self._record_landed(recv, landed)
            return  # NOTE: where D sees writes (TCP) the guard recorded this write already
        note = PushNotification.decode(raw)
        recv = self._live_recv(note.transfer_id, note.registration_id) if note is not None else None
        if note is None or recv is None:
            return  # a full local hit's notification, or one for a receive that ended
        if recv.state == "cancelling":  # every write of P's had finished: the blocks are safe
            recv.safe = True
            return
        if not self.sees_writes:
            if note.landed is not None:
                self._record_landed(recv, note.landed)
            if recv.num_landed != note.num_landed:  # one went missing or came after this one
                recv.landed = None
        self._finish(recv, note.checksums)

    def _live_recv(self, transfer_id: str, registration_id: str) -> _Recv | None:
        recv = self._by_registration.get(registration_id)
        return recv if recv is not None and recv.spec.transfer_id == transfer_id else None

    def _record_landed(self, recv: _Recv, note: PushLanded) -> None:
        """Engine thread: a one-sided write's bytes landed; sum its blocks now (the prompt blocks
        [start, end) sit in the local blocks the registration listed from `first_block` on)."""
        landed, spec = recv.landed, recv.spec
        if landed is None:
            return
        first = spec.first_block
        layers_ok = all(0 <= layer < len(self.kv_layers) for layer in note.layers)
        if not (first <= note.start < note.end <= first + len(spec.local_block_ids) and layers_ok):
            logger.warning("NixlPushConnector: request %s: a landed write names prompt blocks [%d, %d) "
                           "layers %s outside its registration; verifying at the end instead",
                           spec.req_id, note.start, note.end, note.layers[:8])
            recv.landed = None
            return
        try:
            landed.record(spec.local_block_ids[note.start - first:note.end - first], note.layers)
        except Exception:
            logger.exception("NixlPushConnector: cannot sum a landed write; verifying at the end instead")
            recv.landed = None

    def _finish(self, recv: _Recv, checksums: list[int]) -> None:
        spec = recv.spec
        self._forget(recv)
        results = self._results
        results.finished.add(spec.req_id)
        num_bytes = len(spec.local_block_ids) * self.identity.layout.block_bytes * len(self.kv_layers)
        results.count("bytes_loaded", num_bytes)
        results.count("tokens_loaded", len(spec.local_block_ids) * self.identity.block_size)
        results.count("seconds_loading", time.monotonic() - recv.started)
        if recv.aborted or not self.config.verify_checksum:
            return
        # NOTE: where D heard every write land, their sums were taken then: only combining is left
        local = recv.landed.digests() if recv.landed is not None else None
        if local is None:
            local = security.block_digests(self.kv_layers, spec.local_block_ids)
        bad = ([b for b, got, want in zip(spec.local_block_ids, local, checksums, strict=True) if got != want]
               if len(checksums) == len(local) else list(spec.local_block_ids))
        if bad:
            logger.warning("NixlPushConnector: request %s: %d of %d pushed blocks failed their checksum; "
                           "recovering per kv_load_failure_policy", spec.req_id, len(bad), len(local))
            results.invalid_block_ids.update(bad)
            results.count("checksum_failures")
            results.count("load_failures")

    def _on_landed(self, registration_id: str, block_ids: Sequence[int], layers: Sequence[int]) -> None:
        """A transport thread: a write for the registration landed; take its checksum sums now."""
        recv = self._by_registration.get(registration_id)
        landed = recv.landed if recv is not None else None
        if recv is None or landed is None:
            return
        try:
            landed.record(block_ids, layers)
        except Exception:  # NOTE: never break the write: the completing write counts it all again
            logger.exception("NixlPushConnector: cannot sum a landed write; verifying at the end instead")
            recv.landed = None

    # ---------------------------------------------------------------- failures

    def _give_up(self, recv: _Recv, reason: str) -> None:
        """Stop the receive. Its failure is reported once no write of P's can land any more."""
        if recv.state == "cancelling":
            return
        recv.state, recv.failure = "cancelling", reason
        self.guard.close(recv.registration_id)
        with self._send_lock:  # from here on no registration or heartbeat for it leaves
            self._given_up.add(recv.registration_id)
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
            lease = max(recv.lease_s, self._lease_bound())
            last = max(recv.last_contact, peer.last_beat_sent if peer is not None else 0.0)
            recv.safe_after = last + timeout + lease + max(timeout, theirs)
        if peer is not None:  # NOTE: also before registering, so P frees the request at once
            peer.thread.submit(functools.partial(self._cancel_job, recv=recv))
        self._check_cancelled(recv, time.monotonic())

    def _lease_bound(self) -> float:
        """The longest lease P may hold on one of our registrations from a renewal."""
        return self.config.heartbeat_seconds * 3

    def _check_cancelled(self, recv: _Recv, now: float) -> None:
        admitted = self.guard.in_flight(recv.registration_id)
        if self.sees_writes and admitted == 0:
            recv.safe = True  # NOTE: the guard admits nothing more for it, and nothing is landing
        if not recv.safe and now < recv.safe_after:
            return
        if not recv.safe:
            logger.warning("NixlPushConnector: request %s: P never confirmed the cancel; its lease on "
                           "the registration has run out", recv.spec.req_id)
        self._forget(recv)
        if not recv.aborted:
            logger.warning("NixlPushConnector: request %s %s; recovering per kv_load_failure_policy",
                           recv.spec.req_id, recv.failure)
            self._results.count("load_failures")
        self._results.failed.add(recv.spec.req_id)

    def _forget(self, recv: _Recv) -> None:
        self.guard.close(recv.registration_id)
        with self._send_lock:
            self._given_up.discard(recv.registration_id)
        self._recvs.pop(recv.spec.req_id, None)
        self._by_registration.pop(recv.registration_id, None)

    def _fail_now(self, req_id: str, reason: str) -> None:
        logger.warning("NixlPushConnector: request %s %s; recovering per kv_load_failure_policy",
                       req_id, reason)
        self._results.count("load_failures")
        self._results.failed.add(req_id)

    def _drop_peer(self, peer: _Peer, reason: str) -> None:
        if self._peers.get((peer.host, peer.port)) is peer:
            del self._peers[(peer.host, peer.port)]
        peer.thread.close(timeout_s=0.0)
        self._closing.append(peer.thread)
        for recv in list(self._recvs.values()):
            if (recv.spec.remote_host, recv.spec.remote_port) == (peer.host, peer.port):
                self._give_up(recv, reason)

    def close(self) -> None:
        self._recvs.clear()
        self._by_registration.clear()
        self.transport.set_write_guard(None)
        threads = [peer.thread for peer in self._peers.values()] + self._closing
        self._peers.clear()
        for thread in threads:
            thread.close()
        self._closing = []
        self._ctx.term()

"""D's pulls: handshake with each prefill rank, pin the lease, read, verify, report.

One pull per request and P rank it reads from (p2p/tp_plan.py: one between equal TP sizes, several
when this rank's KV heads live on several of P's ranks), driven by the engine thread (`start`,
`abort`, `poll`); everything that waits on the network runs on one `PeerThread` per P rank,
which posts its results to a queue the engine thread drains. A pull moves through

    handshake (until its peer answered)  ->  pin (P checks and extends the lease, sends the
    blocks' checksums)  ->  reading (transport)  ->  finished_recving, or failed_recving

and any failure on the way (refused params, handshake refused or timed out, mismatched peer,
lease gone, transfer error, deadline, checksum mismatch, P restarted) ends in failed_recving or
invalid blocks, after which the scheduler applies the failure policy. When a pull ends without a
read, P is told with a release, so it frees the blocks without waiting for the lease to expire.
A request settles once, when every one of its pulls did: finished when all of them finished,
failed (once) when any failed; the first failure gives up the siblings that have not started
reading, and a read in flight is waited for.
"""

from __future__ import annotations

import functools
import logging
import queue
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import zmq

from kvrelay.kv_transfer.compat import kv_incompatibility
from kvrelay.kv_transfer.layouts import convert_blocks
from kvrelay.kv_transfer.p2p import security
from kvrelay.kv_transfer.p2p.handshake import HandshakeAnswered, HandshakeReply, LocalIdentity
from kvrelay.kv_transfer.p2p.results import LoadResults
from kvrelay.kv_transfer.p2p.tp_plan import RankRead, plan_reads
from kvrelay.kv_transfer.pull.messages import PullMessages
from kvrelay.kv_transfer.pull.meta import LEASE_ALIVE, LEASE_PENDING, LeaseRef, PullSpec
from kvrelay.kv_transfer.pull.state import (
    HeartbeatAnswered,
    Peer,
    PinAnswered,
    PullEvent,
    PullStage,
    RankPull,
    RequestPulls,
)
from kvrelay.kv_transfer.side_channel import PeerThread
from kvrelay.kv_transfer.transport.base import TransferState
from kvrelay.kv_transfer.wakeup import WakingQueue

if TYPE_CHECKING:
    import torch

    from kvrelay.kv_transfer.p2p.settings import NixlConfig
    from kvrelay.kv_transfer.transport.base import KVTransport

logger = logging.getLogger(__name__)

class Puller:
    def __init__(self, transport: KVTransport, identity: LocalIdentity, config: NixlConfig,
                 channel_key: bytes, kv_layers: Sequence[torch.Tensor]) -> None:
        self.transport = transport
        self.identity = identity
        self.config = config
        self.channel_key = channel_key
        self.kv_layers = list(kv_layers)
        self._ctx = zmq.Context()
        self._peers: dict[str, Peer] = {}
        self._pulls: dict[tuple[str, int], RankPull] = {}
        self._requests: dict[str, RequestPulls] = {}
        self._events: queue.Queue[PullEvent] = WakingQueue()
        self._results = LoadResults()
        self._closing: list[PeerThread] = []  # threads of dropped peers, joined in close()
        self._messages = PullMessages(identity, config, self._events)

    def has_pending(self) -> bool:
        return bool(self._pulls)

    # ---------------------------------------------------------------- engine thread: intake

    def start(self, spec: PullSpec) -> None:
        if spec.rejected is not None:
            self._results.count("params_rejected")
            self._fail_now(spec.req_id, f"refused its kv_transfer_params: {spec.rejected}")
            return
        me = self.identity
        try:
            plan = plan_reads(me.num_kv_heads, spec.remote_tp_size, me.tp_size, me.tp_rank, me.head_bytes)
        except ValueError as e:
            self._results.count("tp_mismatch")
            self._fail_now(spec.req_id, f"comes from a prefill instance with tp_size {spec.remote_tp_size}, "
                           f"which this decode instance (tp_size {me.tp_size}) cannot pair with: {e}")
            return
        for source in plan.releases:  # P ranks nobody reads from: they may free at once
            self._release(self._peer_for(spec, source), spec, source.num_readers)
        if spec.notify_only:  # a full local hit: nothing to read, P may free the blocks
            for source in plan.reads:
                self._release(self._peer_for(spec, source), spec, source.num_readers)
            return
        self._requests[spec.req_id] = RequestPulls(spec, pending=len(plan.reads))
        deadline = time.monotonic() + self.config.transfer_timeout_seconds
        for source in plan.reads:
            peer = self._peer_for(spec, source)
            pull = RankPull(spec, source, peer.key, deadline=deadline)
            self._pulls[pull.key] = pull
            if peer.reply is not None:
                self._pin(peer, pull)

    def abort(self, req_id: str) -> None:
        """The request finished while loading. A read in flight completes (its blocks are freed
        once it settled); anything earlier ends now and P is told."""
        for pull in [p for p in self._pulls.values() if p.spec.req_id == req_id]:
            if pull.stage in (PullStage.READING, PullStage.CANCELLING):
                pull.aborted = True
            else:
                self._fail(pull, "aborted before its read started", count=False)

    def _peer_for(self, spec: PullSpec, source: RankRead) -> Peer:
        # NOTE: P's rank r listens on kv_port + r.
        port = spec.remote_port + source.p_rank
        key = f"{spec.remote_engine_id}#{source.p_rank}"
        peer = self._peers.get(key)
        if peer is not None and (peer.host, peer.port, peer.tp_size) != (spec.remote_host, port,
                                                                         spec.remote_tp_size):
            self._drop_peer(peer, f"engine {peer.engine_id} moved to {spec.remote_host}:{port} "
                                  f"(tp_size {spec.remote_tp_size})")
            peer = None
        if peer is None:
            beats: list[Peer] = []  # NOTE: the thread needs its peer, the peer its thread
            thread = PeerThread(self._ctx, spec.remote_host, port, self.channel_key,
                                name=f"kv-peer-{spec.remote_engine_id[:8]}-{source.p_rank}",
                                heartbeat=lambda client: self._messages.heartbeat(client, beats[0]),
                                heartbeat_s=self.config.heartbeat_seconds)
            peer = Peer(key, spec.remote_engine_id, source.p_rank, spec.remote_tp_size,
                         source.remote_block_bytes, spec.remote_host, port, thread)
            beats.append(peer)
            self._peers[key] = peer
            thread.submit(functools.partial(self._messages.handshake, peer=peer))
        return peer

    # ---------------------------------------------------------------- engine thread: progress

    def poll(self) -> LoadResults:
        """Advance every pull; return what settled since the last call."""
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            match event:
                case HandshakeAnswered():
                    self._on_handshake(event)
                case PinAnswered():
                    self._on_pin(event)
                case HeartbeatAnswered():
                    self._on_heartbeat(event)
        now = time.monotonic()
        for pull in list(self._pulls.values()):
            if pull.stage == PullStage.READING:
                self._check_read(pull, now)
            elif pull.stage == PullStage.CANCELLING:
                self._check_cancelled(pull, now)
            elif now >= pull.deadline:
                self._fail(pull, f"gave up after {self.config.transfer_timeout_seconds:.1f} s "
                                 f"(still in the {pull.stage} stage)", stat="timeouts")
        for peer in self._peers.values():
            held = [p for p in self._pulls.values()
                    if p.peer_key == peer.key and p.stage != PullStage.CANCELLING]
            peer.leases = tuple(LeaseRef(p.spec.remote_request_id, p.spec.lease_id) for p in held)
        results, self._results = self._results, LoadResults()
        return results

    def _on_handshake(self, event: HandshakeAnswered[Peer]) -> None:
        peer, reply, error = event.peer, event.reply, event.error
        if self._peers.get(peer.key) is not peer:
            return  # a peer dropped meanwhile
        if reply is not None and error is None:
            error = self._incompatibility(peer, reply)
            if error is not None:
                self._results.count("handshakes_incompatible")
        if reply is not None and error is None:
            try:
                self.transport.remove_remote(peer.key)  # a restarted peer: forget the old one
                self.transport.add_remote(peer.key, reply.agent_metadata, reply.layout())
            except Exception as e:
                error = (f"cannot connect the {self.identity.backend} transport to engine "
                         f"{peer.engine_id}: {e}")
        if error is not None:
            self._drop_peer(peer, error)
            return
        assert reply is not None
        peer.reply = reply
        peer.thread.heartbeat_s = min(self.config.heartbeat_seconds, reply.lease_seconds / 3)
        logger.info("NixlConnector: handshake with engine %s rank %d at %s:%d done (%s, %d blocks)",
                    peer.engine_id, peer.p_rank, peer.host, peer.port, reply.backend, reply.num_blocks)
        for pull in list(self._pulls.values()):
            if pull.peer_key == peer.key and pull.stage == PullStage.HANDSHAKE:
                self._pin(peer, pull)

    def _incompatibility(self, peer: Peer, reply: HandshakeReply) -> str | None:
        me = self.identity
        where = f"the KV side channel at {peer.host}:{peer.port}"
        if reply.transfer_mode != "pull":
            return (f"{where} runs transfer_mode {reply.transfer_mode!r} (NixlPushConnector) and this "
                    "decode instance 'pull' (NixlConnector): run both with the same kv_connector")
        if reply.engine_id != peer.engine_id:
            return (f"{where} is engine {reply.engine_id}, the params name {peer.engine_id} "
                    "(did the prefill instance restart?)")
        difference = kv_incompatibility(me.fingerprint, me.fingerprint_digest, me.tp_size,
                                        reply.fingerprint, reply.fingerprint_digest, reply.tp_size,
                                        convert_layouts=True)
        if difference is not None:
            return (f"{where} holds KV we cannot use ({difference}); pair the decode instance with a "
                    "prefill instance of the same model and --kv-cache-dtype")
        mismatches = [(name, theirs, ours) for name, theirs, ours in (
            ("backend", reply.backend, me.backend), ("block_size", reply.block_size, me.block_size),
            ("layer_names", reply.layer_names, list(me.layout.layer_names)),
            ("block_bytes", reply.block_bytes, peer.block_bytes), ("tp_size", reply.tp_size, peer.tp_size),
            ("tp_rank", reply.tp_rank, peer.p_rank))
            if theirs != ours]
        if mismatches:
            text = ", ".join(f"{name}: theirs {theirs!r}, ours {ours!r}" for name, theirs, ours in mismatches)
            return f"{where} has an incompatible KV layout ({text}); configure both instances alike"
        return None

    def _pin(self, peer: Peer, pull: RankPull) -> None:
        assert peer.reply is not None
        out_of_range = [b for b in pull.spec.remote_block_ids if b >= peer.reply.num_blocks]
        if out_of_range:
            self._results.count("params_rejected")
            self._fail(pull, f"its params name blocks {out_of_range} outside engine {peer.engine_id}'s "
                             f"pool of {peer.reply.num_blocks}", release=False)
            return
        pull.stage = PullStage.PIN
        spec, deadline = pull.spec, pull.deadline
        ranges = [(r.remote_offset, r.length) for r in pull.source.ranges or ()]
        peer.thread.submit(lambda client: self._messages.pin(client, peer, spec, deadline, ranges))

    def _on_pin(self, event: PinAnswered) -> None:
        peer, status = event.peer, event.status
        if self._peers.get(peer.key) is not peer:
            return  # asked a peer that was dropped since (its pulls were failed or moved)
        pull = self._pulls.get(event.pull_key)
        if pull is None or pull.stage != PullStage.PIN:
            return  # NOTE: a pull that ended meanwhile released its lease when it ended
        if status is not None and not self._same_instance(peer, event.sender):
            return
        if status is None or status.state != LEASE_ALIVE:
            reason = event.error or f"P answered {status.state!r}: {status.error}"  # type: ignore[union-attr]
            self._fail(pull, f"could not pin its lease on engine {peer.engine_id}: {reason}",
                       release=status is not None)
            return
        if self.config.verify_checksum and len(status.checksums) != len(pull.spec.remote_block_ids):
            self._fail(pull, "P sent no checksums for its blocks")
            return
        pull.checksums = status.checksums
        pull.source_layout = str(peer.reply.fingerprint.get("layout", "")) if peer.reply else ""
        self._keep_safe(pull, event.sent_at, status.remaining_s)
        self._start_read(pull)

    def _on_heartbeat(self, event: HeartbeatAnswered) -> None:
        peer = event.peer
        if self._peers.get(peer.key) is not peer or not self._same_instance(peer, event.sender):
            return
        by_remote_id = {p.spec.remote_request_id: p for p in self._pulls.values() if p.peer_key == peer.key}
        for status in event.statuses:
            pull = by_remote_id.get(status.request_id)
            if pull is None or status.state == LEASE_PENDING:
                continue
            if status.state == LEASE_ALIVE:
                self._keep_safe(pull, event.sent_at, status.remaining_s)
            elif pull.stage in (PullStage.HANDSHAKE, PullStage.PIN):
                self._fail(pull, f"its lease on engine {peer.engine_id} ended: {status.error}", release=False)

    def _same_instance(self, peer: Peer, sender: str) -> bool:
        """False (and every pull from the peer failed) when P restarted since the handshake."""
        if peer.reply is None or sender == peer.reply.instance_id:
            return True
        self._drop_peer(peer, f"engine {peer.engine_id} restarted since the handshake", retry=True)
        return False

    @staticmethod
    def _keep_safe(pull: RankPull, sent_at: float, remaining_s: float) -> None:
        # NOTE: measured from before the question was sent, minus a margin for the step that
        # notices: P holds the blocks at least this long.
        margin = max(0.25, 0.05 * remaining_s)
        pull.safe_until = max(pull.safe_until, sent_at + remaining_s - margin)

    def _start_read(self, pull: RankPull) -> None:
        spec = pull.spec
        notification = f"{spec.remote_request_id}:{pull.source.num_readers}".encode()
        try:
            pull.handle = self.transport.read_blocks(pull.peer_key, spec.local_block_ids,
                                                     spec.remote_block_ids, notification,
                                                     ranges=pull.source.ranges)
        except Exception as e:
            self._fail(pull, f"the transport refused the read: {e}")
            return
        pull.stage = PullStage.READING
        pull.read_started = time.monotonic()

    def _check_read(self, pull: RankPull, now: float) -> None:
        assert pull.handle is not None
        state = pull.handle.poll()
        if state == TransferState.DONE:
            self._complete(pull)
        elif state == TransferState.ERROR:
            self._fail(pull, f"the read failed: {pull.handle.error}")
        elif now >= pull.deadline:
            self._fail(pull, f"the read did not finish within {self.config.transfer_timeout_seconds:.1f} s",
                       stat="timeouts")
        elif now >= pull.safe_until:
            self._fail(pull, "its lease could not be kept alive (heartbeats unanswered)", stat="timeouts")

    def _complete(self, pull: RankPull) -> None:
        spec = pull.spec
        assert pull.handle is not None
        pull.handle.release()
        del self._pulls[pull.key]
        ranges = pull.source.ranges
        block_bytes = self.identity.layout.block_bytes if ranges is None else sum(r.length for r in ranges)
        self._results.count("bytes_loaded", len(spec.local_block_ids) * block_bytes * len(self.kv_layers))
        self._results.count("seconds_loading", time.monotonic() - pull.read_started)
        request = self._requests[spec.req_id]
        if not pull.aborted and self.config.verify_checksum:
            local_ranges = None if ranges is None else [(r.local_offset, r.length) for r in ranges]
            local = security.block_digests(self.kv_layers, spec.local_block_ids, local_ranges)
            pairs = zip(spec.local_block_ids, local, pull.checksums, strict=True)
            bad = [block_id for block_id, got, want in pairs if got != want]
            if bad:
                logger.warning("NixlConnector: request %s: %d of %d blocks from P rank %d failed their "
                               "checksum; recovering per kv_load_failure_policy", spec.req_id, len(bad),
                               len(local), pull.source.p_rank)
                request.invalid_block_ids.update(bad)
        our_layout = str(self.identity.fingerprint.get("layout", ""))
        if not pull.aborted and pull.source_layout and pull.source_layout != our_layout:
            # NOTE: after the checksums, which cover P's bytes; the handshake allowed only a
            # conversion layouts.py has, of whole blocks.
            intact = [b for b in spec.local_block_ids if b not in request.invalid_block_ids]
            convert_blocks(self.kv_layers, intact, pull.source_layout, our_layout)
        self._settle(pull, failed=False, count=False)

    def _settle(self, pull: RankPull, failed: bool, count: bool) -> None:
        """One of a request's pulls ended; report the request when it was the last."""
        request = self._requests[pull.spec.req_id]
        request.pending -= 1
        request.count_failure = request.count_failure or count
        if failed and not request.failed:
            request.failed = True
            for sibling in [p for p in self._pulls.values() if p.spec.req_id == pull.spec.req_id]:
                if sibling.stage in (PullStage.HANDSHAKE, PullStage.PIN):  # NOTE: each settles through here
                    self._fail(sibling, f"gave up: its read from P rank {pull.source.p_rank} failed",
                               count=False)
        if request.pending > 0 or self._requests.get(pull.spec.req_id) is not request:
            return
        del self._requests[pull.spec.req_id]
        results = self._results
        if request.failed:
            if request.count_failure:
                results.count("load_failures")
            results.failed.add(pull.spec.req_id)
            return
        results.finished.add(pull.spec.req_id)
        results.count("tokens_loaded", len(pull.spec.local_block_ids) * self.identity.block_size)
        if request.invalid_block_ids:
            results.invalid_block_ids.update(request.invalid_block_ids)
            results.count("checksum_failures")
            results.count("load_failures")

    # ---------------------------------------------------------------- endings

    def _fail(self, pull: RankPull, reason: str, release: bool = True, count: bool = True,
              stat: str | None = None) -> None:
        """End a pull unsuccessfully. A read still in flight is cancelled first: the failure is
        reported only once the transport says it settled, so no byte lands in a block the
        scheduler already handed to the recompute."""
        if pull.stage == PullStage.CANCELLING or self._pulls.get(pull.key) is not pull:
            return
        if stat is not None:
            self._results.count(stat)
        state = None if pull.handle is None else pull.handle.poll()
        if state == TransferState.PENDING:
            # NOTE: released only if the read does not complete: a completed read notified P,
            # and P counting one reader twice would free blocks another D rank still reads.
            assert pull.handle is not None
            pull.handle.release()  # ask the transport to cancel; some finish the read anyway
            pull.stage, pull.failure, pull.release_on_settle = PullStage.CANCELLING, reason, release
            pull.deadline = time.monotonic() + self.config.transfer_timeout_seconds
            return
        if release and state != TransferState.DONE:
            self._release_pull(pull)
        self._report_failed(pull, reason, count)

    def _check_cancelled(self, pull: RankPull, now: float) -> None:
        assert pull.handle is not None
        state = pull.handle.poll()
        if state == TransferState.PENDING:
            if now < pull.deadline:
                return
            logger.error("NixlConnector: request %s: the transport neither finished nor cancelled "
                         "its read; reporting the failure anyway", pull.spec.req_id)
        if pull.release_on_settle and state != TransferState.DONE:
            self._release_pull(pull)
        self._report_failed(pull, pull.failure, count=not pull.aborted)

    def _report_failed(self, pull: RankPull, reason: str, count: bool) -> None:
        if pull.handle is not None:
            pull.handle.release()
        del self._pulls[pull.key]
        if count:
            logger.warning("NixlConnector: request %s (P rank %d) %s; recovering per kv_load_failure_policy",
                           pull.spec.req_id, pull.source.p_rank, reason)
        self._settle(pull, failed=True, count=count)

    def _fail_now(self, req_id: str, reason: str) -> None:
        logger.warning("NixlConnector: request %s %s; recovering per kv_load_failure_policy", req_id, reason)
        self._results.count("load_failures")
        self._results.failed.add(req_id)

    def _release(self, peer: Peer, spec: PullSpec, num_consumers: int) -> None:
        peer.thread.submit(lambda client: PullMessages.release(client, spec, num_consumers))

    def _release_pull(self, pull: RankPull) -> None:
        peer = self._peers.get(pull.peer_key)
        if peer is not None:
            self._release(peer, pull.spec, pull.source.num_readers)

    def _drop_peer(self, peer: Peer, reason: str, retry: bool = False) -> None:
        """Forget a peer. Its pulls fail, or with `retry` (it restarted) the ones that did not
        start reading go through a fresh handshake: their leases decide whether they survived."""
        if self._peers.get(peer.key) is peer:
            del self._peers[peer.key]
        peer.thread.close(timeout_s=0.0)  # NOTE: stops at its next poll; joined in close()
        self._closing.append(peer.thread)
        if peer.reply is not None:
            try:
                self.transport.remove_remote(peer.key)
            except Exception:
                logger.exception("NixlConnector: removing engine %s from the transport failed",
                                 peer.engine_id)
        for pull in list(self._pulls.values()):
            if pull.peer_key != peer.key:
                continue
            if retry and pull.stage in (PullStage.HANDSHAKE, PullStage.PIN):
                logger.info("NixlConnector: request %s: %s; handshaking again", pull.spec.req_id, reason)
                pull.stage = PullStage.HANDSHAKE
                self._peer_for(pull.spec, pull.source)
            else:
                self._fail(pull, reason, release=False)

    def close(self) -> None:
        """Cancel every pull and stop every peer thread."""
        for pull in list(self._pulls.values()):
            if pull.handle is not None:
                pull.handle.release()
        self._pulls.clear()
        self._requests.clear()
        threads = [peer.thread for peer in self._peers.values()] + self._closing
        self._peers.clear()
        for thread in threads:
            thread.close()
        self._closing = []
        self._ctx.term()


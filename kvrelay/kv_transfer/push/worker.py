"""The push connector's worker side: the transport, P's sender and side channel, D's receiver.

Everything here that touches the transport runs on the engine thread (start_step, save_layer,
end_step, get_finished); the side-channel server thread hands registrations, heartbeats and
cancels to the sender, which takes its own lock; D's peer threads only talk to the network.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from kvrelay.kv_transfer.compat import kv_incompatibility
from kvrelay.kv_transfer.p2p import path_check, security, settings
from kvrelay.kv_transfer.p2p.handshake import LocalIdentity, handshake_reply, model_kv_heads
from kvrelay.kv_transfer.push.meta import (
    NixlPushMetadata,
    PushCancel,
    PushHeartbeat,
    PushRegister,
    PushStatuses,
)
from kvrelay.kv_transfer.push.receiver import PushReceiver
from kvrelay.kv_transfer.push.sender import PushSender
from kvrelay.kv_transfer.side_channel import SideChannelServer, decode
from kvrelay.outputs import KVConnectorOutput

if TYPE_CHECKING:
    import msgspec
    import torch

    from kvrelay.kv_transfer.base import KVCacheSpec
    from kvrelay.kv_transfer.config import KVTransferConfig
    from kvrelay.kv_transfer.p2p.settings import PushConfig
    from kvrelay.kv_transfer.transport.base import KVTransport, RegionLayout


class PushWorker:
    """The worker half: the transport, P's sender and side channel, D's receiver."""

    def __init__(self, transfer_config: KVTransferConfig, nixl_config: PushConfig, keys: security.Keys,
                 kv_spec: KVCacheSpec) -> None:
        self.transfer_config = transfer_config
        self.nixl_config = nixl_config
        self.keys = keys
        self.kv_spec = kv_spec
        self.instance_id = secrets.token_hex(8)
        self.transport: KVTransport | None = None
        self.layout: RegionLayout | None = None
        self.sender: PushSender | None = None
        self.receiver: PushReceiver | None = None
        self.server: SideChannelServer | None = None
        self._layer_index: dict[str, int] = {}
        self._startup_stats: dict[str, float] = {}  # the path check's figure, reported once

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = list(self.kv_spec.layer_names)
        kv_layers = [kv_caches[name] for name in names]
        self._layer_index = {name: i for i, name in enumerate(names)}
        device = str(next(iter(kv_caches.values())).device)
        self._startup_stats = path_check.startup_stats(self.nixl_config, self.transfer_config,
                                                       self.keys.transport, device, self.kv_spec.tp_rank)
        self.transport = settings.make_transport(self.nixl_config, self.transfer_config, self.keys.transport)
        self.layout = self.transport.register_kv_caches({name: kv_caches[name] for name in names})
        self.transport.expect_remote_access(False)  # until a push to send or to receive says otherwise
        if self.transfer_config.is_producer:
            self.sender = PushSender(self.transport, self.kv_spec, self.layout, self.nixl_config, kv_layers,
                                     model_kv_heads(self.kv_spec))
            # NOTE: one side channel per rank, on kv_port + tp_rank: D's ranks register with the P
            # ranks that hold their KV heads (p2p/tp_plan.py), and learn P's size from rank 0.
            self.server = SideChannelServer(
                self.transfer_config.kv_ip, self.transfer_config.kv_port + self.kv_spec.tp_rank,
                self.keys.channel, self.instance_id,
                {"handshake": self._on_handshake, "push_register": self._on_register,
                 "push_heartbeat": self._on_heartbeat, "push_cancel": self._on_cancel})
        if self.transfer_config.is_consumer:
            identity = LocalIdentity.of(self.transfer_config, self.nixl_config, self.kv_spec, self.layout)
            self.receiver = PushReceiver(self.transport, identity, self.instance_id, self.nixl_config,
                                         self.keys.channel, kv_layers)

    # ---------------------------------------------------------------- every step (engine thread)

    def start_step(self, meta: NixlPushMetadata) -> None:
        if self.sender is not None:
            self.sender.begin_step(meta)
        if meta.recvs or meta.aborted_recvs:
            assert self.receiver is not None, "push receives reached a worker that is not a consumer"
            for recv in meta.recvs:
                self.receiver.start(recv)
            for req_id in meta.aborted_recvs:
                self.receiver.abort(req_id)
        self._expect_access()

    def uses_layer_hooks(self) -> bool:
        return self.sender is not None and self.sender.writes_this_step()

    def save_layer(self, layer_name: str) -> None:
        if self.sender is not None:
            self.sender.save_layer(self._layer_index[layer_name])

    def end_step(self) -> None:
        if self.sender is not None:
            self.sender.end_step()

    def get_finished(self) -> KVConnectorOutput:
        output = KVConnectorOutput()
        output.stats.update(self._startup_stats)  # once: the start-up loopback figure
        self._startup_stats = {}
        if self.sender is not None:
            output.finished_sending, stats = self.sender.poll()
            output.stats.update(stats)
        if self.receiver is not None:
            received = self.receiver.poll()
            output.finished_recving = received.finished
            output.failed_recving = received.failed
            output.invalid_block_ids = received.invalid_block_ids
            for key, value in received.stats.items():
                output.stats[key] = output.stats.get(key, 0) + value
        self._expect_access()
        return output

    def has_pending_work(self) -> bool:
        return (self.sender is not None and self.sender.has_pending()) or (
            self.receiver is not None and self.receiver.has_pending())

    def _expect_access(self) -> None:
        """Tell the transport whether peers may touch our blocks: while D awaits pushes or P
        has pushes to send."""
        if self.transport is not None:
            self.transport.expect_remote_access(self.has_pending_work())

    # ---------------------------------------------------------------- side channel (server thread)

    def _on_handshake(self, body: bytes) -> tuple[str, msgspec.Struct]:
        assert self.layout is not None and self.transport is not None
        return "handshake_reply", handshake_reply(
            self.transfer_config, self.nixl_config, self.kv_spec, self.layout,
            self.transport.agent_metadata(), self.instance_id, transfer_mode="push",
            transfer_timeout_seconds=self.nixl_config.transfer_timeout_seconds)

    def _on_register(self, body: bytes) -> tuple[str, msgspec.Struct]:
        assert self.sender is not None and self.layout is not None
        request: PushRegister = decode(body, PushRegister)
        return "push_status", self.sender.register(request, self._identity_problem(request))

    def _identity_problem(self, request: PushRegister) -> str | None:
        """Why D's rank holds KV we cannot write, or None. Its TP size, rank, byte ranges and block
        size are the sender's to check, against its own plan (nixl_push_state.reader_plan)."""
        assert self.layout is not None
        difference = kv_incompatibility(dict(self.kv_spec.fingerprint), self.kv_spec.fingerprint_digest(),
                                        self.kv_spec.tp_size, request.fingerprint, request.fingerprint_digest,
                                        request.tp_size)
        if difference is not None:
            return f"the decode instance runs another model or KV format ({difference})"
        theirs = (request.backend, request.block_size, len(request.layer_names))
        ours = (self.nixl_config.backend, self.kv_spec.block_size, len(self.layout.layer_names))
        if theirs != ours:
            return f"incompatible KV layout (backend, block_size, layers): theirs {theirs}, ours {ours}"
        return None

    def _on_heartbeat(self, body: bytes) -> tuple[str, msgspec.Struct]:
        assert self.sender is not None
        heartbeat: PushHeartbeat = decode(body, PushHeartbeat)
        statuses = self.sender.heartbeat(heartbeat.refs, heartbeat.sent_at, heartbeat.max_age_s)
        return "push_statuses", PushStatuses(statuses=statuses)

    def _on_cancel(self, body: bytes) -> tuple[str, msgspec.Struct]:
        assert self.sender is not None
        return "push_status", self.sender.cancel(decode(body, PushCancel))

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        if self.sender is not None:
            self.sender.release_all()
            self.sender = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None

"""The pull connector's worker side: the transport, P's leases and side channel, D's pulls.

Everything here that touches the transport runs on the engine thread (in start_load_kv and
get_finished); the side-channel server thread only reads the lease table and checksums held
blocks; D's peer threads only talk to the network.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING

from kvrelay.kv_transfer.p2p import path_check, security, settings
from kvrelay.kv_transfer.p2p.handshake import LocalIdentity, handshake_reply
from kvrelay.kv_transfer.pull.leases import LeaseTable
from kvrelay.kv_transfer.pull.meta import (
    LEASE_REFUSED,
    HeartbeatRequest,
    LeaseStatus,
    LeaseStatuses,
    NixlConnectorMetadata,
    PinRequest,
    ReleaseRequest,
)
from kvrelay.kv_transfer.pull.puller import Puller
from kvrelay.kv_transfer.side_channel import SideChannelServer, decode
from kvrelay.outputs import KVConnectorOutput

if TYPE_CHECKING:
    import msgspec
    import torch

    from kvrelay.kv_transfer.base import KVCacheSpec
    from kvrelay.kv_transfer.config import KVTransferConfig
    from kvrelay.kv_transfer.p2p.settings import NixlConfig
    from kvrelay.kv_transfer.transport.base import KVTransport, RegionLayout

logger = logging.getLogger(__name__)


class NixlWorker:
    def __init__(self, transfer_config: KVTransferConfig, nixl_config: NixlConfig,
                 keys: security.Keys, kv_spec: KVCacheSpec) -> None:
        self.transfer_config = transfer_config
        self.nixl_config = nixl_config
        self.keys = keys
        self.kv_spec = kv_spec
        self.instance_id = secrets.token_hex(8)  # tells this process apart from a restarted one
        self.transport: KVTransport | None = None
        self.layout: RegionLayout | None = None
        self.kv_layers: list[torch.Tensor] = []
        self.leases: LeaseTable | None = None
        self.server: SideChannelServer | None = None
        self.puller: Puller | None = None
        self._startup_stats: dict[str, float] = {}  # the path check's figure, reported once

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_layers = [kv_caches[name] for name in self.kv_spec.layer_names]
        device = str(next(iter(kv_caches.values())).device)
        self._startup_stats = path_check.startup_stats(self.nixl_config, self.transfer_config,
                                                       self.keys.transport, device, self.kv_spec.tp_rank)
        self.transport = settings.make_transport(self.nixl_config, self.transfer_config, self.keys.transport)
        self.layout = self.transport.register_kv_caches(kv_caches)
        self.transport.expect_remote_access(False)  # until a lease or a pull says otherwise
        if self.transfer_config.is_producer:
            self.leases = LeaseTable(
                self.nixl_config.lease_seconds,
                lambda block_ids, ranges: security.block_digests(self.kv_layers, block_ids, ranges))
            # NOTE: one side channel per rank, on kv_port + tp_rank; D's ranks talk to the P ranks
            # holding their KV heads (p2p/tp_plan.py).
            self.server = SideChannelServer(
                self.transfer_config.kv_ip, self.transfer_config.kv_port + self.kv_spec.tp_rank,
                self.keys.channel,
                self.instance_id, {"handshake": self._on_handshake, "pin": self._on_pin,
                                   "heartbeat": self._on_heartbeat, "release": self._on_release})
        if self.transfer_config.is_consumer:
            identity = LocalIdentity.of(self.transfer_config, self.nixl_config, self.kv_spec, self.layout)
            self.puller = Puller(self.transport, identity, self.nixl_config, self.keys.channel,
                                 self.kv_layers)

    # ---------------------------------------------------------------- every step (engine thread)

    def start_load_kv(self, meta: NixlConnectorMetadata) -> None:
        if meta.leases:
            assert self.leases is not None, "leases reached a worker that is not a producer"
            for lease in meta.leases:
                assert self.transport is not None
                self.transport.stage_for_peers(lease.block_ids)  # host staging copies them out now
                self.leases.add(lease)
        if meta.pulls or meta.aborted_pulls:
            assert self.puller is not None, "pulls reached a worker that is not a consumer"
            for pull in meta.pulls:
                self.puller.start(pull)
            for req_id in meta.aborted_pulls:
                self.puller.abort(req_id)
        self._expect_access()

    def get_finished(self) -> KVConnectorOutput:
        output = KVConnectorOutput()
        output.stats.update(self._startup_stats)  # once: the start-up loopback figure
        self._startup_stats = {}
        if self.leases is not None and self.transport is not None:
            for notification in self.transport.get_notifications():
                self.leases.on_notification(notification)
            ended, num_expired = self.leases.take_ended()
            output.finished_sending = ended
            if num_expired:
                output.stats["lease_expired"] = num_expired
        if self.puller is not None:
            pulled = self.puller.poll()
            output.finished_recving = pulled.finished
            output.failed_recving = pulled.failed
            output.invalid_block_ids = pulled.invalid_block_ids
            output.stats.update(pulled.stats)
        self._expect_access()
        return output

    def has_pending_work(self) -> bool:
        return bool(self.leases) or (self.puller is not None and self.puller.has_pending())

    def _expect_access(self) -> None:
        """Tell the transport whether peers may touch our blocks: while P holds leases (D reads
        them) or D has pulls going (its own reads)."""
        if self.transport is not None:
            self.transport.expect_remote_access(self.has_pending_work())

    # ---------------------------------------------------------------- side channel (server thread)

    def _on_handshake(self, body: bytes) -> tuple[str, msgspec.Struct]:
        assert self.layout is not None and self.transport is not None and self.leases is not None
        return "handshake_reply", handshake_reply(
            self.transfer_config, self.nixl_config, self.kv_spec, self.layout,
            self.transport.agent_metadata(), self.instance_id)

    def _on_pin(self, body: bytes) -> tuple[str, msgspec.Struct]:
        assert self.leases is not None and self.layout is not None
        request = decode(body, PinRequest)
        assert self.transport is not None
        if not self.transport.wait_staged(request.block_ids, self.nixl_config.transfer_timeout_seconds):
            return "lease", LeaseStatus(request_id=request.request_id, state=LEASE_REFUSED,
                                        error="the blocks were not staged to host memory in time")
        block_bytes = self.layout.block_bytes
        outside = [r for r in request.ranges if r[0] < 0 or r[1] <= 0 or r[0] + r[1] > block_bytes]
        if outside:
            return "lease", LeaseStatus(request_id=request.request_id, state=LEASE_REFUSED,
                                        error=f"byte ranges {outside[:4]} fall outside a block of "
                                              f"{block_bytes} bytes")
        return "lease", self.leases.pin(request)

    def _on_heartbeat(self, body: bytes) -> tuple[str, msgspec.Struct]:
        assert self.leases is not None
        return "leases", LeaseStatuses(statuses=self.leases.touch(decode(body, HeartbeatRequest).leases))

    def _on_release(self, body: bytes) -> tuple[str, msgspec.Struct]:
        assert self.leases is not None
        return "lease", self.leases.release(decode(body, ReleaseRequest))

    # ---------------------------------------------------------------- shutdown

    def close(self) -> set[str]:
        """Stop the side channel and the peer threads, close the transport. Returns the requests
        whose leases ended with it (their blocks may be freed)."""
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.puller is not None:
            self.puller.close()
            self.puller = None
        ended = self.leases.release_all() if self.leases is not None else set()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        return ended

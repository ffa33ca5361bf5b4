"""NixlPushConnector: the prefill instance writes a prompt's KV into the decode instance's blocks,
layer by layer, while it is still computing the prompt.

The pull connector (NixlConnector) moves KV after the fact: P computes the whole prompt, then D
reads it. Here the proxy starts both legs at once. D admits the request, allocates blocks for
what its own prefix cache lacks (WAITING_FOR_REMOTE_KVS, unpublished, as for a pull) and
registers them with P over the authenticated side channel. P, as each attention layer finishes,
writes that layer's new blocks into D's (one-sided WRITEs over NIXL, or the TCP transport's
push), so the transfer runs beside the rest of its forward pass and beside its next prefill
chunks; the write that completes the prompt carries the notification, with P's checksums. D
verifies them and promotes the request as after a pull (the minus-one rule; only intact blocks
are published).

    kv_transfer_config = {"kv_connector": "NixlPushConnector", "kv_role": "kv_producer",
                          "kv_ip": "127.0.0.1", "kv_port": 14579,
                          "kv_connector_extra_config": {"backend": "tcp"}}

kv_transfer_params (vLLM's names plus `transfer_mode` and `transfer_id`):
  P's leg   `do_remote_decode` true, `transfer_mode` "push", `transfer_id` (the id both legs
            share; the proxy uses its request id)
  D's leg   `do_remote_prefill` true, `transfer_mode` "push", `remote_request_id` (= the
            transfer id), `remote_host` and `remote_port` (P's side channel)
P answers its leg with `transfer_mode`, `transfer_id`, `remote_engine_id`, `remote_num_tokens`.

Extra config: the pull connector's keys (see nixl.py), same meanings, plus `layerwise` (true;
false writes the whole prompt once P computed it, as vLLM's push does: the baseline the layer-wise
push is measured against). `lease_seconds`: how long P
holds a computed prompt for a registration that has not come; a registration's own lease (P
writes nothing for it once it ran out) is 3 heartbeats, renewed by D's heartbeats.
`transfer_timeout_seconds`: D gives up when P makes no progress for this long (a registration
P has not matched with a request by then is refused).

Side-channel messages (D -> P; authenticated as for a pull, see side_channel.py):
    handshake      -> handshake_reply   P's engine, model, layout and transfer_mode ("push")
    push_register  -> push_status       D's engine, transport agent and layout, the transfer id,
                                        a digest of the prompt, its block ids, its TP rank and
                                        size and the byte ranges of each block it takes
    push_heartbeat -> push_statuses     renews the registrations' leases, reports P's progress
    push_cancel    -> push_status       D gives up: "cancelled" once no write is in flight; for a
                                        registration P never took: that D rank will not register

A pull D paired with a push P (or the reverse) is refused at the handshake, naming both modes;
the request then follows the failure policy (`kv_load_failure_policy`).

Tensor parallelism, any two sizes that can hold the model's KV heads: every rank runs its own
sender or receiver over its own KV shard, and P's rank r listens on kv_port + r. D's rank first
handshakes P's base port (rank 0), whose reply states P's tp_size, and computes the pull's plan
(nixl_tp.plan_reads): the P ranks holding its KV heads and the byte ranges of each block each is
to write (whole blocks between equal sizes: rank r to rank r). It registers with each of them,
stating those ranges, and tells the P ranks nobody reads from (the ones the plan assigns it) with
a push_cancel of a registration they never saw that it will not register, so they free at once;
a full local hit tells every P rank it reads from. P's rank computes the same plan
(nixl_tp.plan_writes), takes a registration only from a D rank it names and with its ranges,
writes each reader its ranges (ranged writes), checksums exactly those bytes per reader, and
frees a request once every reader's push ended (written, failed, cancelled, expired, or
declined) and no write is in flight. D's rank completes a receive when every P rank it reads
from notified and its checksums matched; the executor's aggregator settles a request only when
every D rank reported it, so a failure anywhere applies the failure policy once. Only a size
that cannot hold the model's KV heads is refused, at D's handshake, naming both sizes.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kvrelay.kv_transfer.base import KVCacheSpec, KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from kvrelay.kv_transfer.compat import kv_incompatibility
from kvrelay.kv_transfer.connectors import security
from kvrelay.kv_transfer.connectors.nixl import NixlConfig
from kvrelay.kv_transfer.connectors.nixl_meta import HandshakeReply
from kvrelay.kv_transfer.connectors.nixl_pull import LocalIdentity
from kvrelay.kv_transfer.connectors.nixl_push_meta import (
    NixlPushMetadata,
    PushCancel,
    PushHeartbeat,
    PushRegister,
    PushStatuses,
)
from kvrelay.kv_transfer.connectors.nixl_push_scheduler import NixlPushScheduler
from kvrelay.kv_transfer.connectors.side_channel import SideChannelServer, decode
from kvrelay.outputs import KVConnectorOutput

if TYPE_CHECKING:
    import msgspec
    import torch

    from kvrelay.config import EngineConfig
    from kvrelay.core.sched_output import SchedulerOutput
    from kvrelay.kv_transfer.connectors.nixl_push_receiver import PushReceiver
    from kvrelay.kv_transfer.connectors.nixl_push_sender import PushSender
    from kvrelay.kv_transfer.transport.base import KVTransport, RegionLayout
    from kvrelay.request import Request
    from kvrelay.worker.forward_context import ForwardContext


@dataclass(frozen=True)
class PushConfig(NixlConfig):
    """NixlConnector's settings plus how P writes."""

    layerwise: bool = True

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.layerwise, bool):
            raise ValueError(f"layerwise must be true or false, got {self.layerwise!r}")


class PushWorker:
    """The worker half: the transport, P's sender and side channel, D's receiver."""

    def __init__(self, connector: NixlPushConnector) -> None:
        self.transfer_config = connector.transfer_config
        self.nixl_config = connector.nixl_config
        self.keys = connector.keys
        self.kv_spec = connector.kv_spec
        self.instance_id = secrets.token_hex(8)
        self.transport: KVTransport | None = None
        self.layout: RegionLayout | None = None
        self.sender: PushSender | None = None
        self.receiver: PushReceiver | None = None
        self.server: SideChannelServer | None = None
        self._layer_index: dict[str, int] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvrelay.kv_transfer.connectors import nixl_worker
        from kvrelay.kv_transfer.connectors.nixl_push_receiver import PushReceiver
        from kvrelay.kv_transfer.connectors.nixl_push_sender import PushSender

        names = list(self.kv_spec.layer_names)
        kv_layers = [kv_caches[name] for name in names]
        self._layer_index = {name: i for i, name in enumerate(names)}
        self.transport = nixl_worker.create_transport(self.nixl_config.backend, self.transfer_config,
                                                      secret=self.keys.transport,
                                                      timeout_s=self.nixl_config.transfer_timeout_seconds)
        self.layout = self.transport.register_kv_caches({name: kv_caches[name] for name in names})
        self.transport.expect_remote_access(False)  # until a push to send or to receive says otherwise
        if self.transfer_config.is_producer:
            self.sender = PushSender(self.transport, self.kv_spec, self.layout, self.nixl_config, kv_layers,
                                     nixl_worker.model_kv_heads(self.kv_spec))
            # NOTE: one side channel per rank, on kv_port + tp_rank: D's ranks register with the P
            # ranks that hold their KV heads (nixl_tp.py), and learn P's size from rank 0.
            self.server = SideChannelServer(
                self.transfer_config.kv_ip, self.transfer_config.kv_port + self.kv_spec.tp_rank,
                self.keys.channel, self.instance_id,
                {"handshake": self._on_handshake, "push_register": self._on_register,
                 "push_heartbeat": self._on_heartbeat, "push_cancel": self._on_cancel})
        if self.transfer_config.is_consumer:
            identity = LocalIdentity(
                engine_id=self.transfer_config.engine_id, backend=self.nixl_config.backend,
                block_size=self.kv_spec.block_size, fingerprint_digest=self.kv_spec.fingerprint_digest(),
                fingerprint=dict(self.kv_spec.fingerprint), layout=self.layout,
                tp_rank=self.kv_spec.tp_rank, tp_size=self.kv_spec.tp_size,
                num_kv_heads=nixl_worker.model_kv_heads(self.kv_spec))
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

    def save_layer(self, layer_name: str) -> None:
        if self.sender is not None:
            self.sender.save_layer(self._layer_index[layer_name])

    def end_step(self) -> None:
        if self.sender is not None:
            self.sender.end_step()

    def get_finished(self) -> KVConnectorOutput:
        output = KVConnectorOutput()
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
        layout = self.layout
        return "handshake_reply", HandshakeReply(
            engine_id=self.transfer_config.engine_id, instance_id=self.instance_id,
            backend=self.nixl_config.backend, agent_metadata=self.transport.agent_metadata(),
            layer_names=list(layout.layer_names), num_blocks=layout.num_blocks,
            block_bytes=layout.block_bytes, base_addresses=list(layout.base_addresses),
            device=layout.device, block_size=self.kv_spec.block_size,
            fingerprint_digest=self.kv_spec.fingerprint_digest(), fingerprint=dict(self.kv_spec.fingerprint),
            lease_seconds=self.nixl_config.lease_seconds, transfer_mode="push",
            transfer_timeout_seconds=self.nixl_config.transfer_timeout_seconds,
            tp_size=self.kv_spec.tp_size, tp_rank=self.kv_spec.tp_rank)

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


class NixlPushConnector(KVConnectorBase):
    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_spec: KVCacheSpec) -> None:
        super().__init__(config, role, kv_spec)
        self.nixl_config = cast(PushConfig, PushConfig.from_extra_config(self.extra_config))
        self.keys = security.load_keys(self.nixl_config.secret_file)
        security.check_kv_ip(self.transfer_config.kv_ip, self.keys, warn=role == KVConnectorRole.WORKER)
        self._scheduler: NixlPushScheduler | None = None
        self._worker: PushWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = NixlPushScheduler(self.transfer_config, self.nixl_config, self.keys,
                                                kv_spec.block_size, kv_spec.tp_size)
        else:
            self._worker = PushWorker(self)

    @property
    def scheduler(self) -> NixlPushScheduler:
        if self._scheduler is None:
            raise RuntimeError("this NixlPushConnector is the worker half; scheduler calls go to the "
                               "other one")
        return self._scheduler

    @property
    def worker(self) -> PushWorker:
        if self._worker is None:
            raise RuntimeError("this NixlPushConnector is the scheduler half (or was shut down)")
        return self._worker

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        super().update_connector_output(output)
        self.scheduler.update_connector_output(output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def has_pending_work(self) -> bool:
        if self._scheduler is not None:
            return self._scheduler.has_pending_work()
        return self._worker is not None and self._worker.has_pending_work()

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext) -> None:
        self.worker.start_step(cast(NixlPushMetadata, self.connector_metadata))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        self.worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        self.worker.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        return self.worker.get_finished()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

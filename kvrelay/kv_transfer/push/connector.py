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

Extra config: the pull connector's keys (see pull/connector.py), same meanings, plus `layerwise` (true;
false writes the whole prompt once P computed it, as vLLM's push does: the baseline the layer-wise
push is measured against). `lease_seconds`: how long P
holds a computed prompt for a registration that has not come; a registration's own lease (P
writes nothing for it once it ran out) is 3 heartbeats, renewed by D's heartbeats.
`transfer_timeout_seconds`: D gives up when P makes no progress for this long (a registration
P has not matched with a request by then is refused).

Side-channel messages (D -> P; authenticated as for a pull, see kvrelay/kv_transfer/side_channel.py):
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

from typing import TYPE_CHECKING, Any, cast

from kvrelay.kv_transfer.base import (
    ForwardContextView,
    KVCacheSpec,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
)
from kvrelay.kv_transfer.p2p import security
from kvrelay.kv_transfer.p2p.settings import PushConfig
from kvrelay.kv_transfer.push.meta import NixlPushMetadata
from kvrelay.kv_transfer.push.scheduler import NixlPushScheduler
from kvrelay.outputs import KVConnectorOutput

if TYPE_CHECKING:
    import torch

    from kvrelay.config import EngineConfig
    from kvrelay.core.sched_output import SchedulerOutput
    from kvrelay.kv_transfer.push.worker import PushWorker
    from kvrelay.request import Request


class NixlPushConnector(KVConnectorBase):
    transfer_mode = "push"

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_spec: KVCacheSpec) -> None:
        super().__init__(config, role, kv_spec)
        self.nixl_config = cast(PushConfig, PushConfig.from_extra_config(self.extra_config))
        if self.transfer_config.kv_buffer_device == "cpu":
            raise ValueError("NixlPushConnector does not stage through host memory yet (kv_buffer_device "
                             "'cpu'): use NixlConnector (pull) for host staging")
        self.keys = security.load_keys(self.nixl_config.secret_file)
        security.check_kv_ip(self.transfer_config.kv_ip, self.keys, warn=role == KVConnectorRole.WORKER)
        self._scheduler: NixlPushScheduler | None = None
        self._worker: PushWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = NixlPushScheduler(self.transfer_config, self.nixl_config, self.keys,
                                                kv_spec.block_size, kv_spec.tp_size)
        else:
            from kvrelay.kv_transfer.push.worker import PushWorker

            self._worker = PushWorker(self.transfer_config, self.nixl_config, self.keys, kv_spec)

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

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        self.worker.start_step(cast(NixlPushMetadata, self.connector_metadata))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        self.worker.save_layer(layer_name)

    def uses_layer_hooks(self) -> bool:
        return self.worker.uses_layer_hooks()

    def wait_for_save(self) -> None:
        self.worker.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        return self.worker.get_finished()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

"""NixlConnector: the decode instance pulls a prompt's KV blocks out of the prefill instance.

P (kv_role "kv_producer") computes the prompt of a request whose kv_transfer_params say
`do_remote_decode`, and when it finishes (length-capped at one token) keeps its blocks and
answers with kv_transfer_params naming them. D (kv_role "kv_consumer") receives the same prompt
with those params, allocates blocks for what its own prefix cache lacks, and reads exactly those
blocks from P through the transport while it goes on decoding other requests. "kv_both" does both.

    kv_transfer_config = {"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                          "kv_ip": "127.0.0.1", "kv_port": 14579,
                          "kv_connector_extra_config": {"backend": "tcp"}}

Extra config keys (`kv_connector_extra_config`):

  backend                   "nixl" where NIXL is importable, else "tcp"; or "mooncake" (the
                            Mooncake Transfer Engine, kvrelay[mooncake]), or "cuda_ipc" (GPU KV
                            copied device to device on one host). P and D must agree.
  mooncake_protocol         "tcp" (default) or "rdma": the Transfer Engine's protocol.
  mooncake_device           "" (default). The RDMA device(s) for protocol "rdma", e.g. "mlx5_0".
  lease_seconds             30. P holds an unread request's blocks this long; every pin and
                            heartbeat from D extends the lease to at least this much from then.
  transfer_timeout_seconds  10. D gives up on a request (handshake, pin and read together) after
                            this; the failure policy applies. Also the TCP socket timeout.
  heartbeat_seconds         2. D's heartbeat period for the leases it still waits on (at most a
                            third of P's lease_seconds, which the handshake tells D).
  verify_checksum           true. P checksums the blocks D is about to read; D verifies them.
  secret_file               none. A file holding the cluster secret; wins over KVRELAY_KV_SECRET.
  loopback_check_bytes      16MiB. The start-up loopback transfer that names and measures the
                            path (p2p/path_check.py); 0: no measurement.
  require_device_path       false. True: GPU KV on a path that is not a CUDA one refuses to start.

With `kv_buffer_device: "cpu"` in the transfer config, GPU KV goes through pinned host mirrors
(transport/staging.py): P stages a request's blocks when its lease starts, a pin waits for them.

`kv_ip:kv_port` is the side channel (P binds it; every instance needs its own port). The failure
policy is the transfer config's `kv_load_failure_policy` ("recompute" or "fail").

kv_transfer_params P returns (vLLM's names, plus kvrelay's): `do_remote_prefill` true,
`do_remote_decode` false, `remote_engine_id`, `remote_request_id`, `remote_block_ids` (every
block holding prompt KV, the partial last block included), `remote_host`, `remote_port`,
`tp_size` (P's tensor_parallel_size), `remote_num_tokens`, and `remote_block_size`,
`remote_lease_id` (random),
`remote_lease_expiry_ms` (unix ms) and `signature` (HMAC-SHA256 over those and a digest of the
prompt tokens, under a key derived from the secret).

Side-channel protocol (ZMQ DEALER on D -> ROUTER on P; every message HMAC-signed with a
timestamp and nonce, replies bound to the request's nonce; see kvrelay/kv_transfer/side_channel.py):

    handshake  -> handshake_reply  engine id, instance id, backend, transport agent blob, layout
                                   (layer names, number of blocks, block bytes, base addresses),
                                   block size, model fingerprint, lease seconds; once per P
    pin        -> lease            before reading: P checks lease id, prompt digest and block ids
                                   against its lease, extends it, returns per-block checksums
                                   (over the byte ranges D reads, when it reads a head slice)
    heartbeat  -> leases           every heartbeat_seconds for the leases D still waits on
    release    -> lease            D will not read (aborted, gave up, full local prefix hit):
                                   counts as one consumer done

A completed read carries the notification `"{remote_request_id}:{n}"`, n the number of D ranks
that read from that P rank; P frees a lease once all its consumers are done, or when it expires
(stat `lease_expired`). D never reads after the time
P last promised to hold the blocks (see pull/leases.py), so it never reads a reused block.

Tensor parallelism: every rank runs this connector; P's rank r serves its side channel on
kv_port + r. The TP sizes of P and D may differ (p2p/tp_plan.py): each D rank reads its KV heads'
byte ranges of each block from the P ranks holding them, a replicated head from one replica, and
tells the P ranks nobody reads from to release; a request's load ends once, after every one of
its reads settled.

Refused params (unsigned, forged, for another prompt, expired, malformed, naming blocks outside
P's pool, non-loopback without a secret) still claim the tokens, then fail at once: the failure
policy decides between recomputing locally and failing the request, as for any other failure.

Without a secret the side channel is unauthenticated and restricted to loopback (see
p2p/security.py); a non-loopback kv_ip without a secret is a start-up error.

Call `shutdown()` on both halves when the engine stops: it stops the side-channel and peer
threads and closes the transport.
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
from kvrelay.kv_transfer.p2p.settings import NixlConfig
from kvrelay.kv_transfer.pull.meta import NixlConnectorMetadata
from kvrelay.kv_transfer.pull.scheduler import NixlScheduler
from kvrelay.outputs import KVConnectorOutput

if TYPE_CHECKING:
    import torch

    from kvrelay.config import EngineConfig
    from kvrelay.core.sched_output import SchedulerOutput
    from kvrelay.kv_transfer.pull.worker import NixlWorker
    from kvrelay.request import Request

class NixlConnector(KVConnectorBase):
    transfer_mode = "pull"

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_spec: KVCacheSpec) -> None:
        super().__init__(config, role, kv_spec)
        self.nixl_config = NixlConfig.from_extra_config(self.extra_config)
        keys = security.load_keys(self.nixl_config.secret_file)
        # NOTE: both halves refuse an open side channel; only one warns about loopback mode.
        security.check_kv_ip(self.transfer_config.kv_ip, keys, warn=role == KVConnectorRole.WORKER)
        self._scheduler: NixlScheduler | None = None
        self._worker: NixlWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = NixlScheduler(self.transfer_config, self.nixl_config, keys, kv_spec.block_size,
                                            tp_size=kv_spec.tp_size)
        else:
            from kvrelay.kv_transfer.pull.worker import NixlWorker

            self._worker = NixlWorker(self.transfer_config, self.nixl_config, keys, kv_spec)

    @property
    def scheduler(self) -> NixlScheduler:
        if self._scheduler is None:
            raise RuntimeError("this NixlConnector is the worker half; scheduler calls go to the other one")
        return self._scheduler

    @property
    def worker(self) -> NixlWorker:
        if self._worker is None:
            raise RuntimeError("this NixlConnector is the scheduler half (or was shut down)")
        return self._worker

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta()

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
        self.worker.start_load_kv(cast(NixlConnectorMetadata, self.connector_metadata))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        return None  # a pull: D reads the blocks where they are, nothing is pushed

    def uses_layer_hooks(self) -> bool:
        return False  # loads are whole requests between steps, and P serves blocks where they lie

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        return self.worker.get_finished()

    # ---------------------------------------------------------------- lifecycle

    def shutdown(self) -> None:
        """Stop the side channel, the peer threads and the transport. Idempotent. Leases still
        held end with it (P is going away; its blocks go with it)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None

"""OffloadConnector: KV that outlives its request, in host memory, on disk and in Redis.

Each prompt is cut into chunks of `chunk_tokens` tokens (a whole number of blocks), keyed by a
chained hash of the token prefix rooted in the model fingerprint. What is left past the last
full chunk, the tail, is one more entry, keyed by the chain and the tail's tokens: it serves
only a prompt with exactly that prefix (a longer prompt sharing it uses the full chunks). A new
request loads the longest run of stored entries beyond its local prefix hit instead of
computing it (inside the step when small, in the background when large), so a repeated prompt
of any length computes only its last token; every full prompt chunk it computes is stored, and
its tail once the prompt is computed, without blocking the step. The same instance, a restarted
one (disk) or another one (Redis) finds them later.

    kv_transfer_config = {"kv_connector": "OffloadConnector", "kv_role": "kv_both",
                          "kv_connector_extra_config": {
                              "cpu_bytes": "4GiB", "disk_dir": "/var/cache/kvrelay/kv",
                              "disk_bytes": "64GiB", "remote_url": "redis://127.0.0.1:6379/0"}}

Extra config keys (any subset of the three tiers, at least one):

  chunk_tokens            256. Tokens per stored chunk; a multiple of block_size.
  cpu_bytes               0 (no tier). Host-memory LRU budget, bytes or '4GiB'.
  disk_dir, disk_bytes    none, 16GiB. One file per chunk, LRU by size; survives restarts.
  remote_url              none. redis://host:port/db (chunks are raw string values) or
                          mooncakestore://host:port (a Mooncake Store master; see
                          offload/tiers/mooncake_store.py for its ?segment=&buffer=&protocol= options).
  remote_ttl_seconds      86400. Expiry of each remote chunk (0: none).
  remote_timeout_seconds  0.5. Socket timeouts: a dead or slow Redis costs at most this.
  retry_seconds           5. A failed Redis is skipped (lookups and loads miss) this long.
  sync_load_max_tokens    512. Larger loads run in a background thread while the request waits
                          in WAITING_FOR_REMOTE_KVS; smaller ones inside the step.
  max_pending_stores      16. Chunks copied out of the KV cache and not yet written; further
                          stores are dropped (stat offload_stores_dropped).

Lookups go top-down (cpu, disk, redis); a hit in a lower tier is promoted into the tiers above;
stores go through to every tier. A chunk or tail whose header (key, fingerprint, tail token
count, length, checksum) does not match is a miss: the request recomputes from the last good
chunk and what it recomputes is stored again. A failing tier is
logged once a minute and serves as a miss; the instance keeps serving.

The worker side owns the store; the scheduler side asks it what is stored through a Unix socket
(offload/lookup.py), so the halves share no memory. kv_role "kv_producer" only stores,
"kv_consumer" only loads, "kv_both" does both. Stats keys: see offload/stats.py.
Call `shutdown()` when the engine stops (the finalizer does it when the connector is collected).
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any, cast

from kvrelay.kv_transfer.base import (
    ForwardContextView,
    KVCacheSpec,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
)
from kvrelay.kv_transfer.offload.config import OffloadConfig
from kvrelay.kv_transfer.offload.lookup import LookupClient, LookupServer, ShardedLookupClient, lookup_address
from kvrelay.kv_transfer.offload.meta import OffloadConnectorMetadata
from kvrelay.kv_transfer.offload.stats import OffloadStats
from kvrelay.kv_transfer.offload.store import build_store
from kvrelay.outputs import KVConnectorOutput

if TYPE_CHECKING:
    import torch

    from kvrelay.config import EngineConfig
    from kvrelay.core.sched_output import SchedulerOutput
    from kvrelay.kv_transfer.offload.events import TierEvents
    from kvrelay.kv_transfer.offload.scheduler import OffloadScheduler
    from kvrelay.kv_transfer.offload.worker import OffloadWorker
    from kvrelay.request import Request


def _shard(kv_spec: KVCacheSpec, rank: int) -> str:
    """The name of one rank's store under tensor parallelism ("" at TP 1: the layout of old)."""
    return f"tp{kv_spec.tp_size}-rank{rank}" if kv_spec.tp_size > 1 else ""


class OffloadConnector(KVConnectorBase):
    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_spec: KVCacheSpec) -> None:
        super().__init__(config, role, kv_spec)
        self.offload_config = OffloadConfig.from_extra_config(self.extra_config, self.block_size)
        fingerprint = kv_spec.fingerprint_digest()
        engine_id = self.transfer_config.engine_id
        address = lookup_address(engine_id, self.extra_config, _shard(kv_spec, kv_spec.tp_rank))
        self._scheduler: OffloadScheduler | None = None
        self._worker: OffloadWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            from kvrelay.kv_transfer.offload.scheduler import OffloadScheduler

            client: LookupClient | ShardedLookupClient = LookupClient(address)
            if kv_spec.tp_size > 1:  # every rank's worker serves its own store
                client = ShardedLookupClient([
                    LookupClient(lookup_address(engine_id, self.extra_config, _shard(kv_spec, rank)))
                    for rank in range(kv_spec.tp_size)])
            self._scheduler = OffloadScheduler(
                self.offload_config, self.block_size, fingerprint, client,
                can_load=self.transfer_config.is_consumer, can_save=self.transfer_config.is_producer,
                tier_events=_tier_events(config, kv_spec, client, self.block_size))
            self._finalizer = weakref.finalize(self, client.close)
        else:
            from kvrelay.kv_transfer.offload.worker import OffloadWorker

            stats = OffloadStats()
            payload_bytes = kv_spec.num_layers * self.offload_config.chunk_tokens // self.block_size \
                * kv_spec.block_bytes
            store = build_store(self.offload_config, fingerprint, payload_bytes, stats,
                                shard=_shard(kv_spec, kv_spec.tp_rank))
            worker = OffloadWorker(self.offload_config, kv_spec, store, stats)
            server = LookupServer(address, _weak_answer(worker))
            self._worker = worker
            self._finalizer = weakref.finalize(self, functools.partial(_shutdown_worker, worker, server))

    @property
    def scheduler(self) -> OffloadScheduler:
        if self._scheduler is None:
            raise RuntimeError("this OffloadConnector is the worker side; scheduler calls go to the other")
        return self._scheduler

    @property
    def worker(self) -> OffloadWorker:
        if self._worker is None:
            raise RuntimeError("this OffloadConnector is the scheduler side; worker calls go to the other")
        return self._worker

    def shutdown(self) -> None:
        """Stop the background threads and the lookup channel; the store is closed."""
        self._finalizer()

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        self.scheduler.after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_meta(scheduler_output)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        super().update_connector_output(output)
        self.scheduler.update_connector_output(output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Stores were copied out of the blocks inside their step: nothing pins them now.
        self.scheduler.request_finished(request)
        return False, None

    def take_events(self) -> list[Any]:
        return self.scheduler.take_events()

    def has_pending_work(self) -> bool:
        if self._scheduler is not None:
            return self._scheduler.has_pending_work()
        return self._worker is not None and self._worker.background is not None \
            and self._worker.background.wait_pending(0) > 0

    # ---------------------------------------------------------------- worker side

    @property
    def _meta(self) -> OffloadConnectorMetadata:
        return cast(OffloadConnectorMetadata, self.connector_metadata)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        self.worker.start_load_kv(self._meta)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        return None  # whole chunks are copied out once, after the forward (wait_for_save)

    def uses_layer_hooks(self) -> bool:
        return False  # loads land in start_load_kv, stores leave in wait_for_save

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._meta)

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        settled = self.worker.take_settled()
        return KVConnectorOutput(finished_recving=settled.finished_recving,
                                 invalid_block_ids=settled.invalid_block_ids,
                                 stats=self.worker.stats.take())

    def wait_for_stores(self, timeout_s: float = 60.0) -> bool:
        """Block until every chunk store handed to the writer has been written (or failed)."""
        background = self.worker.background
        return background is None or background.wait_idle(timeout_s)


def _tier_events(config: EngineConfig, kv_spec: KVCacheSpec, client: LookupClient | ShardedLookupClient,
                 block_size: int) -> TierEvents | None:
    """The tiers' KV events (events.py), when the engine publishes KV events."""
    if config.kv_events is None or not config.kv_events.publishes:
        return None
    from kvrelay.kv_transfer.offload.events import TierEvents

    clients = client.clients if isinstance(client, ShardedLookupClient) else [client]
    return TierEvents(clients, [_shard(kv_spec, rank) for rank in range(kv_spec.tp_size)], block_size)


def _weak_answer(worker: OffloadWorker) -> Any:
    """The lookup server's handler, holding the worker weakly (the server thread must not keep
    the worker, its KV tensors and its store alive)."""
    ref = weakref.ref(worker)

    def answer(message: list[Any]) -> Any:
        target = ref()
        return target.answer(message) if target is not None else None
    return answer


def _shutdown_worker(worker: OffloadWorker, server: LookupServer) -> None:
    server.close()
    if worker.background is not None:
        worker.background.stop()
    worker.store.close()

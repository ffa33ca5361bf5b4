"""kvrelay's connectors as vLLM 0.32 KV connectors: thin `KVConnectorBase_V1` subclasses.

Each vLLM connector builds the kvrelay connector of its kind for its role (scheduler or worker)
and forwards every hook to it through translate.py; kvrelay decides, vLLM's scheduler applies the
result (its kv_load_failure_policy decides what a failed load does). Importing this module
imports vLLM: kvrelay.integrations.vllm imports it only when a class is first asked for.

How vLLM 0.32's contract maps (vllm/distributed/kv_transfer/kv_connector/v1/base.py):

    __init__(vllm_config, role, kv_cache_config)   kvrelay's connector for that role, its
                                                   KVCacheSpec described from kv_cache_config
    update_state_after_alloc(req, KVCacheBlocks, n)  the one group's block ids
    build_connector_meta(scheduler_output)         from a translated copy; vLLM's is never
                                                   modified; kvrelay's metadata rides as bytes
    bind_connector_metadata(meta)                  also starts kvrelay's loads and pushes: vLLM
                                                   calls start_load_kv after the forward unless a
                                                   load is synchronous, and a push writes during it
    get_transfer_results(finished)                 finished_sending / finished_recving (failed
                                                   receives too, as vLLM requires) / failed_recving
    get_block_ids_with_load_errors()               the same step's invalid blocks (checksums, a
                                                   lost chunk): vLLM recomputes from the first
    request_finished(req, block_ids)               P keeps its blocks (True) until D read them
    get_kv_connector_stats / build_kv_connector_stats / build_prom_metrics   kvrelay's counters
                                                   in vLLM's log line and /metrics (stats.py)
    shutdown()                                     threads, sockets, transport
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, cast

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata as VllmMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole as VllmRole
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvrelay.config import CacheConfig, EngineConfig
from kvrelay.integrations.vllm.identity import model_identity
from kvrelay.integrations.vllm.kv_layout import (
    UnsupportedVllmCache,
    VllmCacheShape,
    describe_cache,
    kv_cache_spec,
    kvrelay_views,
)
from kvrelay.integrations.vllm.stats import KvrelayConnectorStats, KvrelayPromMetrics
from kvrelay.integrations.vllm.translate import (
    VllmRequestView,
    group_block_ids,
    kvrelay_connector_output,
    kvrelay_scheduler_output,
    kvrelay_transfer_config,
)
from kvrelay.integrations.vllm.version import check_vllm_version
from kvrelay.kv_transfer.base import KVCacheSpec, KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from kvrelay.kv_transfer.factory import create_connector
from kvrelay.outputs import KVConnectorOutput

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput as VllmConnectorOutput
    from vllm.v1.request import Request

    from kvrelay.request import Request as KvrelayRequest

logger = logging.getLogger(__name__)

_NON_CRYPTO_HASHES = ("xxhash", "xxhash_cbor")


@dataclass
class KvrelayVllmMetadata(VllmMetadata):
    """One step's kvrelay metadata as kvrelay serializes it (msgpack): it crosses vLLM's process
    boundary as plain bytes, whatever serializer vLLM uses."""

    payload: bytes


@dataclass(frozen=True)
class _NoForwardContext:
    """What kvrelay's start_load_kv is handed when the adapter starts it at bind time (kvrelay's
    connectors read nothing from it)."""

    attn_metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class KvrelaySetup:
    """What a vLLM instance is to kvrelay: its cache, KVCacheSpec and engine config."""

    shape: VllmCacheShape
    kv_spec: KVCacheSpec
    config: EngineConfig


def kvrelay_setup(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                  kvrelay_connector: str) -> KvrelaySetup:
    """Describe a vLLM instance to kvrelay's connector `kvrelay_connector`; refuses, with the
    reason, what the adapter does not support."""
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise UnsupportedVllmCache(
            "kvrelay's vLLM connectors run with tensor_parallel_size 1 and pipeline_parallel_size 1 in "
            f"this version (this instance: {parallel.tensor_parallel_size} and "
            f"{parallel.pipeline_parallel_size})")
    shape = describe_cache(kv_cache_config, str(vllm_config.cache_config.cache_dtype),
                           str(current_platform.device_type))
    kv_spec = kv_cache_spec(shape, model_identity(vllm_config.model_config), tp_rank=0, tp_size=1)
    assert vllm_config.kv_transfer_config is not None
    transfer = kvrelay_transfer_config(vllm_config.kv_transfer_config, kvrelay_connector, kv_on_host=True)
    config = EngineConfig(cache=CacheConfig(block_size=shape.block_size), kv_transfer=transfer)
    return KvrelaySetup(shape, kv_spec, config)


def log_through_vllm() -> None:
    """kvrelay's log lines (a refused load's reason, a handshake) in vLLM's log and format: vLLM
    configures only its own logger, and a process has no other handler."""
    ours, theirs = logging.getLogger("kvrelay"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


def _view(request: Request) -> KvrelayRequest:
    # NOTE: kvrelay's connectors read (and the pull writes kv_transfer_params of) what the view offers.
    return cast("KvrelayRequest", VllmRequestView(request))


class KvrelayAdapter(KVConnectorBase_V1):
    """The adapter every kvrelay connector shares: forwards vLLM's hooks to `self.kvrelay`."""

    kvrelay_connector: ClassVar[str] = ""  # the kvrelay registry name of the connector it runs
    stats_kind: ClassVar[str] = ""  # its metrics' kind (stats.py)
    reads_scheduler_output: ClassVar[bool] = True  # whether its build_connector_meta reads it

    def __init__(self, vllm_config: VllmConfig, role: VllmRole, kv_cache_config: KVCacheConfig) -> None:
        check_vllm_version()
        log_through_vllm()
        super().__init__(vllm_config, role, kv_cache_config)
        setup = kvrelay_setup(vllm_config, kv_cache_config, self.kvrelay_connector)
        self.shape = setup.shape
        kv_role = KVConnectorRole.SCHEDULER if role == VllmRole.SCHEDULER else KVConnectorRole.WORKER
        self.kvrelay: KVConnectorBase = create_connector(setup.config, kv_role, setup.kv_spec)
        self.kv_spec = setup.kv_spec
        self._step_output = KVConnectorOutput()  # worker: this step's results, asked for in three calls
        logger.info("kvrelay: %s (%s side) runs kvrelay's %s; KV %s, block %d, layout %s, model %s",
                    type(self).__name__, kv_role.value, self.kvrelay_connector, self.shape.dtype,
                    self.shape.block_size, self.shape.layout, setup.kv_spec.fingerprint.get("model"))

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.kvrelay.get_num_new_matched_tokens(_view(request), num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.kvrelay.update_state_after_alloc(_view(request), group_block_ids(blocks.get_block_ids()),
                                              num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> VllmMetadata:
        translated = kvrelay_scheduler_output(scheduler_output) if self.reads_scheduler_output else None
        meta = self.kvrelay.build_connector_meta(translated)  # type: ignore[arg-type]
        return KvrelayVllmMetadata(meta.to_bytes())

    def update_connector_output(self, connector_output: VllmConnectorOutput) -> None:
        self.kvrelay.update_connector_output(kvrelay_connector_output(connector_output))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.kvrelay.request_finished(_view(request), list(block_ids))

    def has_pending_push_work(self) -> bool:
        """vLLM steps an idle engine while this is True (it asks only when no request runs): while
        P's pushes are in flight, or chunk stores whose results (and stats) are not reported yet."""
        return self.kvrelay.has_pending_work()

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kvrelay.register_kv_caches(kvrelay_views(kv_caches, self.shape))

    def bind_connector_metadata(self, connector_metadata: VllmMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, KvrelayVllmMetadata):
            raise TypeError(f"{type(self).__name__} was bound {type(connector_metadata).__name__}, "
                            "not the metadata its scheduler side builds")
        self.kvrelay.bind_connector_metadata(KVConnectorMetadata.from_bytes(connector_metadata.payload))
        # NOTE: started here, before the forward (see the module docstring).
        self.kvrelay.start_load_kv(_NoForwardContext())

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None  # started in bind_connector_metadata

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.kvrelay.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self.kvrelay.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        self.kvrelay.wait_for_save()

    def clear_connector_metadata(self) -> None:
        self.kvrelay.clear_connector_metadata()
        super().clear_connector_metadata()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        output = self.kvrelay.get_finished(set(finished_req_ids))
        self._step_output = output
        return KVConnectorTransferResults(finished_sending=set(output.finished_sending),
                                          finished_recving=output.finished_recving | output.failed_recving,
                                          failed_recving=set(output.failed_recving))

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._step_output.invalid_block_ids = self._step_output.invalid_block_ids, set()
        return invalid

    def get_kv_connector_stats(self) -> KvrelayConnectorStats | None:
        stats, self._step_output.stats = self._step_output.stats, {}
        return KvrelayConnectorStats(data=dict(stats)) if stats else None

    # ---------------------------------------------------------------- lifecycle, metrics

    def shutdown(self) -> None:
        self.kvrelay.shutdown()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvrelayConnectorStats:
        return KvrelayConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KvrelayPromMetrics:
        return KvrelayPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues,
                                  cls.stats_kind)


class KvrelayConnector(KvrelayAdapter):
    """P/D pull: kvrelay's NixlConnector (kvrelay/kv_transfer/pull/connector.py has its keys)."""

    kvrelay_connector = "NixlConnector"
    stats_kind = "pull"
    reads_scheduler_output = False
    _cache_hit_source = CacheHitSource.P2P


class KvrelayPushConnector(KvrelayAdapter):
    """P/D push: kvrelay's NixlPushConnector (kvrelay/kv_transfer/push/connector.py); P writes
    each layer into D's blocks from save_kv_layer, during its own forward."""

    kvrelay_connector = "NixlPushConnector"
    stats_kind = "push"
    _cache_hit_source = CacheHitSource.P2P


class KvrelayOffloadConnector(KvrelayAdapter):
    """The offload tiers: kvrelay's OffloadConnector (kvrelay/kv_transfer/offload/connector.py),
    keyed by vLLM's block hashes (offload_keys.py)."""

    kvrelay_connector = "OffloadConnector"
    stats_kind = "offload"

    def __init__(self, vllm_config: VllmConfig, role: VllmRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        from kvrelay.integrations.vllm.offload_keys import VllmBlockHashKeyer
        from kvrelay.kv_transfer.offload import OffloadConnector

        offload = cast(OffloadConnector, self.kvrelay)
        config = offload.offload_config
        tiers = tuple(t for t, on in (("cpu", config.cpu_bytes), ("disk", config.disk_dir),
                                      ("remote", config.remote_url)) if on)
        sources: dict[tuple[str, ...], CacheHitSource] = {("cpu",): CacheHitSource.HOST,
                                                          ("disk",): CacheHitSource.DISK}
        self._cache_hit_source = sources.get(tiers, CacheHitSource.EXTERNAL_UNSPECIFIED)
        if role == VllmRole.SCHEDULER:
            hash_block_size = kv_cache_config.hash_block_size or self.shape.block_size
            offload.scheduler.keyer = VllmBlockHashKeyer(
                config.chunk_tokens, self.kv_spec.fingerprint_digest(), hash_block_size)
            algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
            if config.remote_url and algo in _NON_CRYPTO_HASHES and os.environ.get("PYTHONHASHSEED") is None:
                logger.warning("kvrelay: prefix_caching_hash_algo %s without PYTHONHASHSEED seeds vLLM's "
                               "block hashes at random per process: other instances will not find this "
                               "one's entries in %s (use sha256, or one PYTHONHASHSEED everywhere)", algo,
                               config.remote_url)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a store that never happened is a later miss

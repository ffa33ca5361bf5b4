"""One rank: its share of the model, its KV shard, its worker-side connector, its model runner.

The same Worker runs in the engine's process (executor `uni`) or in a process of its own
(executor `mp`, see kvrelay.executor.worker_proc).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvrelay.config import EngineConfig
from kvrelay.core.sched_output import SchedulerOutput
from kvrelay.distributed.parallel_state import TensorParallelGroup, rank_device
from kvrelay.kv_transfer.protocols import NULL_WORKER_CONNECTOR, WorkerConnector
from kvrelay.model.llama import build_model
from kvrelay.model.sharding import shard_layout
from kvrelay.model.spec import ModelSpec
from kvrelay.outputs import ModelRunnerOutput
from kvrelay.worker.batch_invariance import configure_cuda
from kvrelay.worker.kv_setup import KVSetup
from kvrelay.worker.memory import GpuMemory, host_staging_bound, kv_cache_bytes, measure_gpu_kv_budget
from kvrelay.worker.model_runner import ModelRunner, bind_device, kv_block_bytes, torch_dtype

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerPlan:
    """What the engine decided before any worker starts: the same for every rank. The KV cache's
    size comes later: each rank measures what it can hold (`Worker.determine_num_blocks`) and the
    engine gives every rank the smallest (`Worker.initialize_kv_cache`)."""

    config: EngineConfig  # resolved: a concrete device and dtype
    spec: ModelSpec  # the whole model's (each rank derives its shard)
    eos_token_ids: tuple[int, ...]
    kv: KVSetup  # the KV cache format, fp8 scales (all KV heads) and compatibility fingerprint


def kv_cache_spec(config: EngineConfig, spec: ModelSpec, kv: KVSetup, tp_rank: int = 0) -> Any:
    """The KVCacheSpec of one rank's cache, from the spec of the model that rank runs."""
    from kvrelay.kv_transfer.base import LAYER_NAME_FORMAT, KVCacheSpec
    return KVCacheSpec(
        block_size=config.cache.block_size, num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=kv.format.name,
        layer_names=[LAYER_NAME_FORMAT.format(i=i) for i in range(spec.num_layers)],
        fingerprint=dict(kv.fingerprint), latent=spec.is_mla, tp_rank=tp_rank,
        tp_size=config.parallel.tensor_parallel_size)


def build_worker_connector(config: EngineConfig, local_spec: ModelSpec, kv: KVSetup,
                           tp_rank: int) -> WorkerConnector:
    if config.kv_transfer is None or config.kv_transfer.kv_connector is None:
        return NULL_WORKER_CONNECTOR
    from kvrelay.kv_transfer.base import KVConnectorRole
    from kvrelay.kv_transfer.factory import create_connector
    connector: WorkerConnector = create_connector(config, KVConnectorRole.WORKER,
                                                  kv_cache_spec(config, local_spec, kv, tp_rank))
    return connector


class Worker:
    def __init__(self, plan: WorkerPlan, weights: Mapping[str, torch.Tensor],
                 tp: TensorParallelGroup | None = None) -> None:
        config = plan.config
        self.config = config
        self.tp = tp or TensorParallelGroup.single()
        mcfg = config.model
        self.device = rank_device(mcfg.device, self.tp.rank)
        if self.device.type == "cuda":
            bind_device(self.device)
            self._baseline = GpuMemory.read(self.device)  # before the weights: see memory.py
            if mcfg.batch_invariant:
                configure_cuda()  # before this process's first matmul
        model = build_model(plan.spec, weights, torch_dtype(mcfg.dtype), self.device, self.tp)
        connector = build_worker_connector(config, model.spec, plan.kv, self.tp.rank)
        scales = plan.kv.scales  # [num_layers, 2, num_kv_heads] of the whole model, fp8 only
        if scales is not None and self.tp.size > 1:
            heads = shard_layout(plan.spec, self.tp.rank, self.tp.size).kv_heads
            scales = scales[:, :, heads.start:heads.stop].contiguous()
        self.runner = ModelRunner(model, model.spec, config.cache.block_size, plan.kv.format.name,
                                  self.device, seed=mcfg.seed, eos_token_ids=plan.eos_token_ids,
                                  connector=connector,
                                  kv_scales=None if scales is None else scales.to(self.device),
                                  attention_backend=mcfg.attention_backend, enforce_eager=mcfg.enforce_eager,
                                  max_num_seqs=config.scheduler.max_num_seqs,
                                  batch_invariant=mcfg.batch_invariant)

    def determine_num_blocks(self) -> int:
        """How many KV blocks this rank can hold: from kv_cache_memory (or the CPU default), or
        on a GPU measured after the weights and a profiling forward of the largest step; on a GPU
        that stages KV through host memory, no more than the host mirror's bound."""
        cache = self.config.cache
        if cache.num_blocks_override is not None:
            return cache.num_blocks_override
        per_block = kv_block_bytes(self.runner.spec, cache.block_size, self.runner.kv_format.name)
        cap = host_staging_bound(self.config.kv_transfer, self.device, self.tp.size)
        budget = kv_cache_bytes(cache, self.device, self._measure_gpu, cap)
        if cap is not None and budget == cap:
            logger.info("rank %d: KV cache capped at %.2f GiB, the bound of its pinned host mirror (host "
                        "staging; kv_transfer_config kv_buffer_size sets it)", self.tp.rank, cap / 1024**3)
        return budget // per_block

    def _measure_gpu(self) -> int:
        sched, utilization = self.config.scheduler, self.config.cache.gpu_memory_utilization
        budget, graph_bytes = measure_gpu_kv_budget(self.runner, self.device, self._baseline, utilization,
                                                    sched.max_num_batched_tokens, sched.max_num_seqs)
        self.runner.graph_reserve = graph_bytes
        logger.info("rank %d: %.2f GiB of %s for the KV cache, %.0f MiB kept for CUDA graphs "
                    "(gpu_memory_utilization %.2f)", self.tp.rank, budget / 1024**3, self.device,
                    graph_bytes / 1024**2, utilization)
        return budget

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.runner.initialize_kv_cache(num_blocks, max_model_len)

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(sched_out)

    def shutdown(self) -> None:
        self.runner.connector.shutdown()

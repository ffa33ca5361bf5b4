"""Small builders for the connector tests: configs, KV specs, requests, scheduler outputs, and
one worker step driven by hand (the calls the model runner makes, in its order)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvrelay.attention.forward_context import ForwardContext, set_forward_context
from kvrelay.config import CacheConfig, EngineConfig
from kvrelay.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvrelay.kv_transfer import KVCacheSpec, KVConnectorBase, KVConnectorMetadata, KVTransferConfig
from kvrelay.outputs import KVConnectorOutput
from kvrelay.request import Request
from kvrelay.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 16


def engine_config(kv_transfer: dict[str, Any] | str | KVTransferConfig | None) -> EngineConfig:
    return EngineConfig(cache=CacheConfig(block_size=BLOCK_SIZE),
                        kv_transfer=KVTransferConfig.from_any(kv_transfer))


def kv_spec(fingerprint: dict[str, Any] | None = None) -> KVCacheSpec:
    return KVCacheSpec(block_size=BLOCK_SIZE, num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32",
                       fingerprint=fingerprint or {"architecture": "llama", "num_layers": 2})


def kv_caches(spec: KVCacheSpec, random: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """Per layer [NUM_BLOCKS, 2, H_kv, block_size, D]: random values, or zeros."""
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, *spec.block_shape)
    return {name: torch.randn(shape, generator=gen) if random else torch.zeros(shape)
            for name in spec.layer_names}


def request(prompt: list[int], request_id: str = "r1") -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(prompt),
                   sampling_params=SamplingParams(max_tokens=4))


def new_req(req: Request, block_ids: list[int], num_computed_tokens: int = 0) -> NewRequestData:
    return NewRequestData(req_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids),
                          output_token_ids=[], sampling_params=req.sampling_params,
                          block_ids=list(block_ids), num_computed_tokens=num_computed_tokens)


def cached_req(req_id: str, num_computed_tokens: int,
               new_block_ids: list[int] | None = None) -> CachedRequestData:
    return CachedRequestData(req_id=req_id, new_block_ids=list(new_block_ids or []),
                             num_computed_tokens=num_computed_tokens, new_token_ids=[])


def sched_output(new: Sequence[NewRequestData] = (), cached: Sequence[CachedRequestData] = (),
                 num_scheduled: dict[str, int] | None = None,
                 finished: set[str] | None = None) -> SchedulerOutput:
    num_scheduled = num_scheduled or {}
    return SchedulerOutput(scheduled_new_reqs=list(new), scheduled_cached_reqs=list(cached),
                           num_scheduled_tokens=num_scheduled,
                           total_num_scheduled_tokens=sum(num_scheduled.values()),
                           finished_req_ids=finished or set())


def prefill(req: Request, block_ids: list[int], num_computed_tokens: int = 0) -> SchedulerOutput:
    """A step that schedules a new request's whole remaining prompt."""
    num_scheduled = {req.request_id: req.num_prompt_tokens - num_computed_tokens}
    return sched_output(new=[new_req(req, block_ids, num_computed_tokens)], num_scheduled=num_scheduled)


def worker_step(worker: KVConnectorBase, meta: KVConnectorMetadata,
                finished_req_ids: set[str] | None = None) -> KVConnectorOutput:
    """What the model runner does around one forward pass, with the metadata sent as bytes."""
    worker.bind_connector_metadata(KVConnectorMetadata.from_bytes(meta.to_bytes()))
    context = ForwardContext(attn_metadata={name: None for name in worker.kv_caches}, kv_connector=worker)
    with set_forward_context(context):
        worker.start_load_kv(context)
        for name, kv_layer in worker.kv_caches.items():
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name, kv_layer, None)
        worker.wait_for_save()
    output = worker.get_finished(finished_req_ids or set())
    worker.clear_connector_metadata()
    return output

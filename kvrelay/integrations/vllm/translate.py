"""vLLM's objects as kvrelay's connectors see them, and back.

Duck-typed on purpose: nothing here imports vLLM, so the translation is tested without it
(tests/integrations/vllm/test_translate.py) and the adapter stays the one place that does.

    vLLM                                      kvrelay
    kv_transfer_config (+ extra config)   ->  KVTransferConfig of kvrelay's connector
    Request                               ->  VllmRequestView (reads and writes through)
    KVCacheBlocks                         ->  block ids of the one KV cache group
    SchedulerOutput                       ->  kvrelay SchedulerOutput (a copy: vLLM's is never
                                              touched; a resumed request is a new one, as in kvrelay)
    KVConnectorOutput (scheduler side)    ->  kvrelay KVConnectorOutput (vLLM lists a failed
                                              receive in finished_recving too; kvrelay does not)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvrelay.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvrelay.kv_transfer.config import KVTransferConfig
from kvrelay.outputs import KVConnectorOutput
from kvrelay.request import RequestStatus
from kvrelay.sampling_params import SamplingParams

# Keys of kv_connector_extra_config that the adapter reads itself; the rest go to kvrelay's
# connector unchanged. vLLM's KVTransferConfig has no kv_ip (its NixlConnector reads an
# environment variable), so the side channel's address is an extra key.
ADAPTER_KEYS = ("kv_ip",)
DEFAULT_KV_IP = "127.0.0.1"

# NOTE: the connectors never read the sampling parameters of a scheduled request.
_UNUSED_SAMPLING = SamplingParams()


def kvrelay_transfer_config(vllm_config: Any, kvrelay_connector: str, kv_on_host: bool) -> KVTransferConfig:
    """kvrelay's transfer config for its connector `kvrelay_connector`, from vLLM's: the same
    engine id (both halves and both processes agree on it), role, failure policy, side-channel
    port and extra config. With the KV in host memory there is nothing to stage: kvrelay's
    kv_buffer_device "cpu" would build a host mirror of the pool, so the KV is used where it is."""
    extra = dict(vllm_config.kv_connector_extra_config or {})
    kv_ip = extra.pop("kv_ip", DEFAULT_KV_IP)
    buffer_device = "cuda" if kv_on_host else str(vllm_config.kv_buffer_device)
    return KVTransferConfig(
        kv_connector=kvrelay_connector, kv_role=str(vllm_config.kv_role or "kv_both"),
        kv_connector_extra_config=extra, kv_load_failure_policy=str(vllm_config.kv_load_failure_policy),
        engine_id=str(vllm_config.engine_id), kv_ip=kv_ip, kv_port=int(vllm_config.kv_port),
        kv_buffer_device=buffer_device)


def group_block_ids(block_ids: Any) -> list[int]:
    """The block ids of the (only) KV cache group: vLLM hands one list per group."""
    if not block_ids:
        return []
    return list(block_ids[0])


class VllmRequestView:
    """A vLLM Request with the attributes kvrelay's connectors read; `kv_transfer_params` is
    written through (a pull D marks its params used), the status mapped by name."""

    __slots__ = ("_request",)

    def __init__(self, request: Any) -> None:
        self._request = request

    @property
    def request_id(self) -> str:
        return str(self._request.request_id)

    @property
    def prompt_token_ids(self) -> list[int]:
        token_ids = self._request.prompt_token_ids
        if token_ids is None:
            raise ValueError(f"request {self.request_id} has no prompt token ids (prompt embeddings?): "
                             "kvrelay's connectors key and check KV by the prompt's tokens")
        return list(token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return int(self._request.num_prompt_tokens)

    @property
    def num_computed_tokens(self) -> int:
        return int(self._request.num_computed_tokens)

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        params = self._request.kv_transfer_params
        return params if isinstance(params, dict) else None

    @kv_transfer_params.setter
    def kv_transfer_params(self, params: dict[str, Any] | None) -> None:
        self._request.kv_transfer_params = params

    @property
    def status(self) -> RequestStatus:
        return request_status(self._request.status)

    @property
    def block_hashes(self) -> list[bytes]:
        return list(self._request.block_hashes or ())

    @property
    def cache_salt(self) -> str | None:
        return getattr(self._request, "cache_salt", None)

    @property
    def lora_name(self) -> str | None:
        lora = getattr(self._request, "lora_request", None)
        return None if lora is None else str(getattr(lora, "lora_name", lora))

    @property
    def has_multimodal_inputs(self) -> bool:
        return bool(getattr(self._request, "mm_features", None))


def request_status(status: Any) -> RequestStatus:
    """vLLM's status as kvrelay's, by name: vLLM has more waiting and finished kinds."""
    name = getattr(status, "name", str(status))
    if name in RequestStatus.__members__:
        return RequestStatus[name]
    return RequestStatus.FINISHED_ABORTED if name.startswith("FINISHED") else RequestStatus.WAITING


def kvrelay_scheduler_output(out: Any) -> SchedulerOutput:
    """A kvrelay SchedulerOutput of what vLLM scheduled this step (vLLM's object is only read)."""
    new = [_new_request(r.req_id, r.prompt_token_ids or [], r.block_ids, r.num_computed_tokens)
           for r in out.scheduled_new_reqs]
    cached_reqs: list[CachedRequestData] = []
    cached = out.scheduled_cached_reqs
    resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
    all_token_ids: Mapping[str, list[int]] = getattr(cached, "all_token_ids", None) or {}
    for i, req_id in enumerate(cached.req_ids):
        block_ids = cached.new_block_ids[i]
        if req_id in resumed:  # its block list starts over: kvrelay sends such a request in full
            new.append(_new_request(req_id, all_token_ids.get(req_id, []), block_ids,
                                    cached.num_computed_tokens[i]))
        else:
            cached_reqs.append(CachedRequestData(req_id=req_id, new_block_ids=group_block_ids(block_ids),
                                                 num_computed_tokens=cached.num_computed_tokens[i],
                                                 new_token_ids=[]))
    return SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cached_reqs,
                           num_scheduled_tokens=dict(out.num_scheduled_tokens),
                           total_num_scheduled_tokens=int(out.total_num_scheduled_tokens),
                           finished_req_ids=set(out.finished_req_ids))


def _new_request(req_id: str, token_ids: Any, block_ids: Any, num_computed_tokens: int) -> NewRequestData:
    return NewRequestData(req_id=req_id, prompt_token_ids=list(token_ids), output_token_ids=[],
                          sampling_params=_UNUSED_SAMPLING, block_ids=group_block_ids(block_ids),
                          num_computed_tokens=num_computed_tokens)


def kvrelay_connector_output(output: Any) -> KVConnectorOutput:
    """vLLM's aggregated worker output as kvrelay's: a failed receive is in vLLM's
    finished_recving as well (so its scheduler leaves the wait state); kvrelay lists it once."""
    failed = set(output.failed_recving or ())
    return KVConnectorOutput(finished_sending=set(output.finished_sending or ()),
                             finished_recving=set(output.finished_recving or ()) - failed,
                             failed_recving=failed, invalid_block_ids=set(output.invalid_block_ids or ()))

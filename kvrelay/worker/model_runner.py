"""The model runner: turns a SchedulerOutput into one forward pass and sampled tokens.

It owns the paged KV tensors and the per-request state the scheduler sends as a diff. Every
step, with or without tokens to run, it drives the worker-side connector:
bind metadata -> start_load_kv -> forward (layer hooks) -> wait_for_save -> sample ->
get_finished -> clear metadata.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from kvrelay.attention.forward_context import ForwardContext, set_forward_context
from kvrelay.attention.kv_format import kv_dtype_names, kv_format
from kvrelay.attention.layer import build_attention_metadata
from kvrelay.core.sched_output import SchedulerOutput
from kvrelay.kernels.native import log_active_kernels
from kvrelay.kv_transfer.protocols import NULL_WORKER_CONNECTOR, WorkerConnector
from kvrelay.model.llama import CausalLM
from kvrelay.model.sampler import Sampler, SamplingRow, make_generator
from kvrelay.model.spec import ModelSpec
from kvrelay.outputs import ModelRunnerOutput
from kvrelay.sampling_params import SamplingParams
from kvrelay.utils import cdiv
from kvrelay.worker.kv_connector_step import kv_connector_step


def torch_dtype(name: str) -> torch.dtype:
    """A model dtype or resolved KV cache format name -> the torch dtype it stores."""
    if name not in kv_dtype_names():
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(kv_dtype_names())}")
    return kv_format(name).torch_dtype


def kv_block_bytes(spec: ModelSpec, block_size: int, dtype: str) -> int:
    """Bytes one block takes across all layers (K and V), stored as `dtype` (a KV format name)."""
    elem = kv_format(dtype).element_size
    if spec.is_mla:  # one latent per token, no K/V split
        return spec.num_layers * block_size * spec.head_dim * elem
    return spec.num_layers * 2 * spec.num_kv_heads * block_size * spec.head_dim * elem


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + output tokens known to the runner
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)


class ModelRunner:
    def __init__(self, model: CausalLM, spec: ModelSpec, num_blocks: int, block_size: int,
                 dtype: str, device: torch.device, seed: int | None = None,
                 eos_token_ids: tuple[int, ...] = (),
                 connector: WorkerConnector = NULL_WORKER_CONNECTOR,
                 kv_scales: torch.Tensor | None = None) -> None:
        """`dtype`: the KV cache format (kvrelay/attention/kv_format.py: float32, bfloat16, float16,
        fp8_e4m3, fp8_e5m2), whatever the weights' dtype; fp8 needs `kv_scales` [num_layers, 2,
        num_kv_heads] of this rank's KV heads (kvrelay/worker/kv_calibration.py)."""
        self.model = model
        self.spec = spec
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler(seed)
        self.connector = connector  # worker-side KV connector (the null one without KV transfer)
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_format = kv_format(dtype)
        if self.kv_format.is_fp8 != (kv_scales is not None):
            raise ValueError(f"KV cache format {dtype} {'needs' if self.kv_format.is_fp8 else 'takes no'} "
                             "kv_scales")
        self.kv_scales = kv_scales
        self.kv_caches = self._allocate_kv_caches(num_blocks, self.kv_format.torch_dtype)
        log_active_kernels(device)  # which native CPU kernels serve this model, once per process
        connector.register_kv_caches(self.kv_caches)

    def _allocate_kv_caches(self, num_blocks: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        spec = self.spec
        caches = {}
        for i, (name, layer) in enumerate(self.model.attention_layers().items()):
            # [num_blocks, 2 (K, V), H_kv, block_size, D], or with MLA [num_blocks, block_size,
            # kv_lora_rank + qk_rope_head_dim]: a block's bytes are contiguous
            shape = ((num_blocks, self.block_size, spec.head_dim) if spec.is_mla
                     else (num_blocks, 2, spec.num_kv_heads, self.block_size, spec.head_dim))
            cache = _zeros_on_huge_pages(shape, dtype, self.device)
            layer.kv_cache = cache
            layer.kv_format = self.kv_format
            layer.kv_scales = None if self.kv_scales is None else self.kv_scales[i].contiguous()  # [2, Hkv]
            caches[name] = cache
        return caches

    # ----------------------------------------------------------------------------- step
    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched_out)
        with kv_connector_step(self.connector, sched_out) as step:
            output = self._forward_and_sample(sched_out)
        output.kv_connector_output = step.output
        return output

    def _forward_and_sample(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        connector = self.connector
        req_ids = list(sched_out.num_scheduled_tokens)
        batch = self._prepare_inputs(req_ids, sched_out.num_scheduled_tokens) if req_ids else None
        attn_metadata = {name: batch["attn_metadata"] for name in self.kv_caches} if batch else {}
        context = ForwardContext(attn_metadata=attn_metadata, kv_connector=connector)
        with set_forward_context(context):
            connector.start_load_kv(context)
            hidden = self.model(batch["input_ids"], batch["positions"]) if batch else None
            connector.wait_for_save()
        if batch is None or hidden is None:
            return ModelRunnerOutput.empty()
        return self._sample(req_ids, batch, hidden)

    def _prepare_inputs(self, req_ids: list[str], num_scheduled: dict[str, int]) -> dict[str, Any]:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, block_tables = [], [], []
        for req_id in req_ids:
            state = self.requests[req_id]
            n = num_scheduled[req_id]
            start = state.num_computed_tokens
            input_ids.extend(state.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            block_tables.append(state.block_ids)
        meta = build_attention_metadata(query_lens, seq_lens, block_tables, self.block_size, self.device)
        return {
            "input_ids": torch.tensor(input_ids, dtype=torch.long, device=self.device),
            "positions": torch.tensor(positions, dtype=torch.long, device=self.device),
            "attn_metadata": meta,
            "query_lens": query_lens,
            "seq_lens": seq_lens,
        }

    def _sample(self, req_ids: list[str], batch: dict[str, Any],
                hidden: torch.Tensor) -> ModelRunnerOutput:
        # A request samples when this step computed its last known token.
        sample_idx, sampling_ids = [], []
        last = -1
        for req_id, q_len, seq_len in zip(req_ids, batch["query_lens"], batch["seq_lens"], strict=True):
            last += q_len
            if seq_len == len(self.requests[req_id].token_ids):
                sample_idx.append(last)
                sampling_ids.append(req_id)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, Any] = {}
        if sample_idx:
            idx = torch.tensor(sample_idx, dtype=torch.long, device=hidden.device)
            # NOTE: every rank takes part (the LM head is vocab-parallel above TP 1, the same
            # rows on every rank); only rank 0 gets the logits and samples.
            logits = self.model.compute_logits(hidden[idx])  # [num_sampling, vocab]
            if logits is None:
                return ModelRunnerOutput.empty()
            rows = [self._sampling_row(self.requests[rid]) for rid in sampling_ids]
            token_ids, token_logprobs = self.sampler(logits, rows)
            for rid, tok, lp in zip(sampling_ids, token_ids, token_logprobs, strict=True):
                sampled[rid] = [tok]
                logprobs[rid] = lp
        elif not self.model.tp.is_first:
            return ModelRunnerOutput.empty()
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[sampled.get(rid, []) for rid in req_ids],
            logprobs=[logprobs.get(rid) for rid in req_ids],
        )

    @staticmethod
    def _sampling_row(state: CachedRequestState) -> SamplingRow:
        prompt_len = state.num_prompt_tokens
        return SamplingRow(params=state.sampling_params, prompt_token_ids=state.token_ids[:prompt_len],
                           output_token_ids=state.token_ids[prompt_len:],
                           eos_token_ids=state.eos_token_ids, generator=state.generator)

    # ----------------------------------------------------------------------------- state
    def _update_states(self, sched_out: SchedulerOutput) -> None:
        for req_id in sched_out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in sched_out.scheduled_new_reqs:
            previous = self.requests.get(new.req_id)  # a resumed request keeps its generator
            params = new.sampling_params
            generator = previous.generator if previous is not None else (
                make_generator(params.seed) if params.seed is not None else None)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling_params=params, generator=generator, eos_token_ids=self.eos_token_ids)
        for cached in sched_out.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens


_MADV_HUGEPAGE = 14  # linux/mman.h
_HUGE_PAGE = 2 * 1024 * 1024


def _zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, whose host memory Linux may back with 2 MB pages (transparent huge pages in
    "madvise" mode, the common default), asked for before the pages are first touched.

    The decode kernel reads blocks scattered over the cache; with 4 KB pages nearly every 4 KB it
    reads costs a TLB miss. Measured on the decode kernel at batch 64 x 264 tokens: ~7% faster.
    Anywhere else (another OS, a GPU, THP off) this is plain torch.zeros."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    if device.type == "cpu" and sys.platform == "linux":
        start = tensor.data_ptr()
        first = cdiv(start, _HUGE_PAGE) * _HUGE_PAGE  # the whole 2 MB pages inside the tensor
        last = (start + tensor.numel() * tensor.element_size()) // _HUGE_PAGE * _HUGE_PAGE
        if last > first:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_HUGEPAGE)
            except (OSError, AttributeError):  # no libc symbol: stay on small pages
                pass
    return tensor.zero_()

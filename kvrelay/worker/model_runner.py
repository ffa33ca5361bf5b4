"""The model runner: turns a SchedulerOutput into one forward pass and sampled tokens.

It owns the paged KV tensors and the per-request state the scheduler sends as a diff
(requests.py). Every step, with or without tokens to run, it drives the worker-side connector:
bind metadata -> start_load_kv -> forward (layer hooks) -> wait_for_save -> sample ->
get_finished -> clear metadata.

A step's inputs are built with numpy and reach the device in one copy each way (staging.py);
the attention backend, chosen once at start, turns them into the step's metadata. On a GPU,
decode-only steps replay a captured CUDA graph (cuda_graphs.py) unless `enforce_eager` is set or
the connector has per-layer work in that step. Start-up is in two parts: the runner first exists
without a KV cache (so the worker can measure the memory a forward takes), then
`initialize_kv_cache` allocates the blocks the engine settled on.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from typing import Any

import torch

from kvrelay.attention.backends import AttentionBackend, select_backend
from kvrelay.attention.forward_context import ForwardContext, set_forward_context
from kvrelay.attention.kv_format import kv_dtype_names, kv_format
from kvrelay.attention.metadata import StepBatch
from kvrelay.core.sched_output import SchedulerOutput
from kvrelay.kernels.native import log_active_kernels
from kvrelay.kv_transfer.protocols import NULL_WORKER_CONNECTOR, WorkerConnector
from kvrelay.model.invariant import make_batch_invariant
from kvrelay.model.llama import CausalLM
from kvrelay.model.sampler import Sampler, SamplingRow
from kvrelay.model.spec import ModelSpec
from kvrelay.outputs import ModelRunnerOutput
from kvrelay.sampling_params import SamplingParams
from kvrelay.utils import cdiv
from kvrelay.worker.cuda_graphs import DecodeGraphs
from kvrelay.worker.kv_connector_step import kv_connector_step
from kvrelay.worker.requests import RequestTable
from kvrelay.worker.staging import InputStaging

logger = logging.getLogger(__name__)


def torch_dtype(name: str) -> torch.dtype:
    """A model dtype or resolved KV cache format name -> the torch dtype it stores."""
    if name not in kv_dtype_names():
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(kv_dtype_names())}")
    return kv_format(name).torch_dtype


def bind_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (nothing elsewhere). CUDA's current
    device is per thread, and eager Triton kernels and `torch.cuda.Event.record()` go to it, not
    to their tensors' device; the thread that runs the steps (AsyncLLM's engine thread) is not
    the one that built the worker, so each step binds it."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def kv_block_bytes(spec: ModelSpec, block_size: int, dtype: str) -> int:
    """Bytes one block takes across all layers (K and V), stored as `dtype` (a KV format name)."""
    elem = kv_format(dtype).element_size
    if spec.is_mla:  # one latent per token, no K/V split
        return spec.num_layers * block_size * spec.head_dim * elem
    return spec.num_layers * 2 * spec.num_kv_heads * block_size * spec.head_dim * elem


class ModelRunner:
    def __init__(self, model: CausalLM, spec: ModelSpec, block_size: int, dtype: str, device: torch.device,
                 seed: int | None = None, eos_token_ids: tuple[int, ...] = (),
                 connector: WorkerConnector = NULL_WORKER_CONNECTOR, kv_scales: torch.Tensor | None = None,
                 attention_backend: str = "auto", enforce_eager: bool = False,
                 max_num_seqs: int = 64, batch_invariant: bool = False) -> None:
        """`dtype`: the KV cache format (kvrelay/attention/kv_format.py: float32, bfloat16, float16,
        fp8_e4m3, fp8_e5m2), whatever the weights' dtype; fp8 needs `kv_scales` [num_layers, 2,
        num_kv_heads] of this rank's KV heads (kvrelay/worker/kv_calibration.py).
        `batch_invariant`: the model and attention take their batch-invariant routes when the
        cache is set up (kvrelay/worker/batch_invariance.py)."""
        self.model = model
        self.spec = spec
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler(seed)
        self.connector = connector  # worker-side KV connector (the null one without KV transfer)
        self.kv_format = kv_format(dtype)
        if self.kv_format.is_fp8 != (kv_scales is not None):
            raise ValueError(f"KV cache format {dtype} {'needs' if self.kv_format.is_fp8 else 'takes no'} "
                             "kv_scales")
        self.kv_scales = kv_scales
        self.attention_backend = attention_backend
        self.enforce_eager = enforce_eager
        self.max_num_seqs = max_num_seqs
        self.batch_invariant = batch_invariant
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.staging = InputStaging(device)
        self.backend: AttentionBackend | None = None
        self.graphs: DecodeGraphs | None = None
        self.graph_reserve = 0  # bytes the KV budget kept for the CUDA graphs (worker/memory.py)
        self.graph_pool_bytes = 0  # what their capture took, for the log and the GPU tests
        self.requests: RequestTable | None = None

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate `num_blocks` blocks per layer, choose the attention backend, register the cache
        with the connector and, on a GPU, capture the decode graphs."""
        spec = self.spec
        self.backend = select_backend(self.attention_backend, self.device, spec.num_kv_heads, spec.head_dim,
                                      max_model_len, latent=spec.is_mla, batch_invariant=self.batch_invariant)
        if self.batch_invariant:
            make_batch_invariant(self.model, max_model_len)
        self.kv_caches = self._allocate_kv_caches(num_blocks, self.kv_format.torch_dtype)
        self.requests = RequestTable(self.block_size, cdiv(max_model_len, self.block_size),
                                     self.eos_token_ids, self.device, capacity=self.max_num_seqs)
        log_active_kernels(self.device)  # which native CPU kernels serve this model, once per process
        logger.info("attention backend %s on %s, %d KV blocks of %d tokens%s", self.backend.name, self.device,
                    num_blocks, self.block_size, ", batch-invariant" if self.batch_invariant else "")
        self.connector.register_kv_caches(self.kv_caches)
        if self.captures_graphs:
            self._capture_graphs(max_model_len)

    @property
    def captures_graphs(self) -> bool:
        """Whether decode steps will replay CUDA graphs (a GPU, the Triton route, no enforce_eager,
        TP 1)."""
        if self.device.type != "cuda" or self.enforce_eager or self.model.tp.size != 1:
            return False
        backend = self.backend or select_backend(self.attention_backend, self.device, self.spec.num_kv_heads,
                                                 self.spec.head_dim, 1, latent=self.spec.is_mla)
        return backend.supports_cuda_graphs

    def _capture_graphs(self, max_model_len: int) -> None:
        assert self.backend is not None
        bind_device(self.device)
        torch.cuda.empty_cache()  # NOTE: each capture empties the cache on entry: count from empty
        before = torch.cuda.memory_reserved(self.device)
        self.graphs = DecodeGraphs(self.model, self.backend, list(self.kv_caches), self.max_num_seqs,
                                   max_model_len, self.block_size, self.device)
        with torch.inference_mode():
            self.graphs.capture_all()
        torch.cuda.empty_cache()  # the last warm-up's blocks; the graphs' private pool stays
        self.graph_pool_bytes = torch.cuda.memory_reserved(self.device) - before
        logger.info("CUDA graphs took %.0f MiB of the device (the KV budget kept %.0f MiB for them)",
                    self.graph_pool_bytes / 1024**2, self.graph_reserve / 1024**2)

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
            layer.backend = self.backend
            caches[name] = cache
        return caches

    # ----------------------------------------------------------------------------- step
    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        assert self.requests is not None, "initialize_kv_cache must come before the first step"
        bind_device(self.device)
        self.requests.update(sched_out)
        with kv_connector_step(self.connector, sched_out) as step:
            output = self._forward_and_sample(sched_out)
        output.kv_connector_output = step.output
        return output

    def _forward_and_sample(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        assert self.requests is not None and self.backend is not None
        connector = self.connector
        req_ids = list(sched_out.num_scheduled_tokens)
        if not req_ids:
            context = ForwardContext(attn_metadata={}, kv_connector=connector)
            with set_forward_context(context):
                connector.start_load_kv(context)
                connector.wait_for_save()
            return ModelRunnerOutput.empty()
        threshold = self.backend.reorder_batch_threshold
        if threshold is not None:
            req_ids = decodes_first(req_ids, sched_out.num_scheduled_tokens, threshold)
        batch, input_ids = self.requests.step_inputs(req_ids, sched_out.num_scheduled_tokens)
        input_ids_dev = self.staging.upload(batch, input_ids)
        meta = self.backend.build_metadata(batch)
        context = ForwardContext({name: meta for name in self.kv_caches}, kv_connector=connector)
        with set_forward_context(context):
            connector.start_load_kv(context)
            if self._replays(batch):
                assert self.graphs is not None
                hidden = self.graphs.run(batch, input_ids_dev)
            else:
                hidden = self.model(input_ids_dev, batch.device_inputs().positions)
            connector.wait_for_save()
        return self._sample(req_ids, batch, hidden)

    def _replays(self, batch: StepBatch) -> bool:
        """A decode-only step of a captured size whose connector has no per-layer work."""
        return (self.graphs is not None and batch.is_decode_only
                and self.graphs.padded_size(batch.num_seqs) is not None
                and not self.connector.uses_layer_hooks())

    def _sample(self, req_ids: list[str], batch: StepBatch, hidden: torch.Tensor) -> ModelRunnerOutput:
        assert self.requests is not None
        # A request samples when this step computed its last known token.
        requests = self.requests
        samples = [i for i, (rid, seq_len) in enumerate(zip(req_ids, batch.seq_lens.tolist(), strict=True))
                   if seq_len == len(requests[rid].token_ids)]  # [N], the sequences that sample
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, Any] = {}
        if samples:
            if len(samples) == hidden.shape[0]:
                rows = hidden
            else:  # each sampling sequence's last row in the batch
                ends = batch.query_start_loc.tolist()
                rows = hidden[torch.tensor([ends[i + 1] - 1 for i in samples], device=hidden.device)]
            # NOTE: every rank takes part (the LM head is vocab-parallel above TP 1, the same
            # rows on every rank); only rank 0 gets the logits and samples.
            logits = self.model.compute_logits(rows)  # [N, vocab]
            if logits is None:
                return ModelRunnerOutput.empty()
            sampling_ids = [req_ids[i] for i in samples]
            sampling_rows = [self.requests[rid].sampling_row() for rid in sampling_ids]
            token_ids, token_logprobs = self.sampler(logits, sampling_rows)
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

    # ----------------------------------------------------------------------------- profiling
    @torch.inference_mode()
    def profile_forward(self, num_tokens: int, num_seqs: int, sample: bool = True) -> int:
        """One forward of `num_tokens` prompt tokens over `num_seqs` sequences, into a temporary
        cache, and the logits of `num_seqs` rows, sampled with the sampler's most expensive
        settings when `sample` (else argmax): what the largest step costs in activations. Returns
        the temporary cache's bytes."""
        num_seqs = max(1, min(num_seqs, num_tokens))
        lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        tables, first = [], 0
        for n in lens:
            tables.append(list(range(first, first + cdiv(n, self.block_size))))
            first += cdiv(n, self.block_size)
        self.backend = select_backend(self.attention_backend, self.device, self.spec.num_kv_heads,
                                      self.spec.head_dim, max(lens), latent=self.spec.is_mla,
                                      batch_invariant=self.batch_invariant)
        saved = self.kv_caches
        try:
            self.kv_caches = self._allocate_kv_caches(first, self.kv_format.torch_dtype)
            batch = StepBatch.from_lists(lens, lens, tables, self.block_size, self.device)
            meta = self.backend.build_metadata(batch)
            with set_forward_context(ForwardContext({name: meta for name in self.kv_caches})):
                hidden = self.model(torch.zeros(num_tokens, dtype=torch.int64, device=self.device),
                                    batch.device_inputs().positions)
            logits = self.model.compute_logits(hidden[torch.from_numpy(batch.query_start_loc[1:] - 1)
                                                      .to(self.device, torch.int64)])  # [num_seqs, vocab]
            if logits is not None and sample:  # a sampler of its own: the engine's draws stay untouched
                Sampler(seed=0)(logits, [_PROFILE_ROW] * num_seqs)
            elif logits is not None:
                logits.argmax(dim=-1).tolist()
            return sum(cache.numel() * cache.element_size() for cache in self.kv_caches.values())
        finally:
            for layer in self.model.attention_layers().values():
                layer.kv_cache = torch.empty(0)
            self.kv_caches = saved
            self.backend = None


# The sampler's most expensive row: every processing stage, a nucleus wide enough for a full sort,
# and logprobs (an extra [rows, vocab] log-softmax).
_PROFILE_ROW = SamplingRow(
    params=SamplingParams(temperature=0.7, top_p=0.999, top_k=0, min_p=0.01, repetition_penalty=1.1,
                          presence_penalty=0.1, frequency_penalty=0.1, logprobs=5),
    prompt_token_ids=[0], output_token_ids=[0], eos_token_ids=(), generator=None)


def decodes_first(req_ids: list[str], num_scheduled: dict[str, int], threshold: int) -> list[str]:
    """`req_ids` with the decodes (at most `threshold` tokens scheduled) first, each part in its
    order: the attention backend then finds a mixed step's decode rows as one leading slice."""
    decodes = [rid for rid in req_ids if num_scheduled[rid] <= threshold]
    if len(decodes) == len(req_ids):
        return req_ids
    return decodes + [rid for rid in req_ids if num_scheduled[rid] > threshold]


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

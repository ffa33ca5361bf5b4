"""The attention backend interface: one route from a step's description to each layer's output.

A backend is chosen once at start (`select_backend`) and serves every layer of the model. Per
step it builds one metadata object from the runner's `StepBatch` (shared by all layers); per
layer, `forward` writes this step's K/V into the layer's paged cache and attends. Every backend
keeps the one KV layout, `[num_blocks, 2, H_kv, block_size, head_dim]` per layer, so the
connectors, their byte ranges and the compatibility digest never know which one ran. The
connector's layer hooks stay in the layer (kvrelay/attention/layer.py), not here.

A backend that can run a decode step inside a CUDA graph also hands out `GraphInputs`: static
buffers the captured layers read, refilled before each replay.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import torch

    from kvrelay.attention.kv_format import KVFormat
    from kvrelay.attention.metadata import StepBatch


class PagedLayer(Protocol):
    """What a backend reads of an attention layer."""

    layer_name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    kv_cache: torch.Tensor  # [num_blocks, 2, H_kv, block_size, head_dim]
    kv_format: KVFormat
    kv_scales: torch.Tensor | None  # [2, H_kv] float32 for fp8 (the cache holds value / scale)


class GraphInputs(ABC):
    """The static buffers of captured decode steps of up to `max_num_seqs` sequences."""

    @abstractmethod
    def metadata_for(self, num_seqs: int) -> Any:
        """What the layers of a step captured at `num_seqs` sequences read: views of the buffers."""

    @abstractmethod
    def fill(self, batch: StepBatch, padded_num_seqs: int) -> None:
        """Copy a decode-only step of `batch.num_seqs` sequences into the buffers, padded to the
        captured size: padded rows write no KV (slot -1) and read no block (length 0)."""


class AttentionBackend(ABC):
    name: ClassVar[str]
    supports_cuda_graphs: ClassVar[bool] = False
    # vLLM's name: sequences with at most this many query tokens are decodes, and the runner puts
    # them first in each step's batch (None: any order).
    reorder_batch_threshold: ClassVar[int | None] = None

    @abstractmethod
    def build_metadata(self, batch: StepBatch) -> Any:
        """This step's metadata, built once and shared by every layer."""

    @abstractmethod
    def forward(self, layer: PagedLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: Any) -> torch.Tensor:
        """q [T, H*D], k/v [T, Hkv*D] (roped; rows may be strided) -> [T, H*D]. Writes this
        step's k/v into `layer.kv_cache` at the step's slots, then attends each query over its
        sequence's whole context."""

    def graph_inputs(self, max_num_seqs: int, max_blocks: int, device: torch.device) -> GraphInputs:
        """Static buffers for captured decode steps (only where `supports_cuda_graphs`)."""
        raise NotImplementedError(f"attention backend {self.name!r} does not run in CUDA graphs")

"""Decode steps replayed from CUDA graphs: one graph per batch size, captured at start.

A decode step launches hundreds of small kernels (a few per layer and sequence batch); launched
one by one from Python they leave the GPU idle most of the time. Captured once per batch size
(1, 2, 4, 8, then every 8 up to `max_num_seqs`) into one shared memory pool, largest first, a
step becomes one replay: the inputs are copied into the graph's static buffers (token ids,
positions, and the attention backend's slots, block tables and lengths), the batch padded to the
next captured size with rows that write no KV and read no block, and the hidden states of the
real rows read back. Prefill and mixed steps run eagerly, and so does any step whose connector
has per-layer work (a replay skips the layer hooks).

The capture itself is a seam (`GraphCapture`): on CUDA it records a `torch.cuda.CUDAGraph`; the
tests run the same buffers and padding on the CPU with a capture that calls the model again at
each replay.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from kvrelay.attention.backends import AttentionBackend
from kvrelay.attention.forward_context import ForwardContext, set_forward_context
from kvrelay.attention.metadata import StepBatch
from kvrelay.utils import cdiv

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every 8 up to max_num_seqs (and it)."""
    sizes = {n for n in (1, 2, 4, 8) if n <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


class Replay(Protocol):
    def replay(self) -> None: ...


class GraphCapture(Protocol):
    def capture(self, run: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        """Record `run` once; returns what replays it and the output tensor every replay fills."""


class CudaGraphCapture:
    """Records into `torch.cuda.CUDAGraph`s sharing one memory pool (capture largest first)."""

    def __init__(self) -> None:
        self.pool: Any = None  # the first graph's memory pool, shared by the others

    def capture(self, run: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        run()  # warm up: Triton compiles, cuBLAS picks its kernels, outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = run()
        self.pool = graph.pool()
        return graph, out


class DecodeGraphs:
    """The captured decode steps of one model, and how to run a step through them."""

    def __init__(self, model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 backend: AttentionBackend, layer_names: list[str], max_num_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device,
                 capture: GraphCapture | None = None) -> None:
        self.model = model
        self.layer_names = layer_names
        self.sizes = capture_sizes(max_num_seqs)
        self.inputs = backend.graph_inputs(max(self.sizes), cdiv(max_model_len, block_size), device)
        self.input_ids = torch.zeros(max(self.sizes), dtype=torch.int64, device=device)
        self.positions = torch.zeros(max(self.sizes), dtype=torch.int64, device=device)
        self.capture = capture or CudaGraphCapture()
        self.graphs: dict[int, tuple[Replay, torch.Tensor]] = {}

    def capture_all(self) -> None:
        """Capture every size, largest first (the smaller graphs reuse the largest's memory).
        The static buffers hold padding while capturing: no KV is written, no block is read."""
        for size in sorted(self.sizes, reverse=True):
            metadata = self.inputs.metadata_for(size)
            context = ForwardContext({name: metadata for name in self.layer_names})

            def run(size: int = size, context: ForwardContext = context) -> torch.Tensor:
                with set_forward_context(context):
                    return self.model(self.input_ids[:size], self.positions[:size])

            self.graphs[size] = self.capture.capture(run)
        logger.info("captured CUDA graphs of decode steps for %d batch sizes (1..%d)", len(self.sizes),
                    max(self.sizes))

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a decode step of `num_seqs` sequences runs at, or None (too many)."""
        return next((size for size in self.sizes if size >= num_seqs), None)

    def run(self, batch: StepBatch, input_ids: torch.Tensor) -> torch.Tensor:
        """A decode-only step -> the hidden states of its `batch.num_seqs` rows."""
        n = batch.num_seqs
        size = self.padded_size(n)
        if size is None or not batch.is_decode_only:
            raise ValueError(f"no captured graph runs a step of {n} sequences (decode only: "
                             f"{batch.is_decode_only}); captured sizes {self.sizes}")
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:size].zero_()
        self.positions[:n].copy_(batch.device_inputs().positions)
        self.positions[n:size].zero_()
        self.inputs.fill(batch, size)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]

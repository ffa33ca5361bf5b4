"""Tensor-parallel state and the few collectives the model needs.

A `TensorParallelGroup` is handed to the model explicitly (no module-level state): the model's
row-parallel layers call `all_reduce`, and a single-rank group (`TensorParallelGroup.single()`)
makes every collective a no-op, so the TP 1 path runs exactly the code it ran before TP existed.

Backends follow the device: `gloo` on the CPU, `nccl` on CUDA.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside a group of size {self.size}")

    @classmethod
    def single(cls) -> TensorParallelGroup:
        return cls(rank=0, size=1)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it (untouched at size 1)."""
        if self.size > 1:
            dist.all_reduce(tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim`, rank order (itself at size 1)."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=dim)

    def gather_to_first(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every rank's `tensor` (all the same shape) concatenated along `dim` in rank order, on
        rank 0; None on the others (the tensor itself at size 1)."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.is_first else None
        dist.gather(tensor, parts, dst=0)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def rank_device(device: str, rank: int) -> torch.device:
    """The device of tensor-parallel rank `rank` of an instance on `device`: one GPU per rank,
    `cuda:rank` (or `cuda:N+rank` from "cuda:N"); the CPU for every rank on the CPU."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    index = (base.index or 0) + rank
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"tensor-parallel rank {rank} of an instance on {device} needs cuda:{index}, "
                         f"but this machine has {count} GPU(s): one GPU per rank")
    return torch.device("cuda", index)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device,
                         timeout_s: float = 120.0) -> TensorParallelGroup:
    """Join the process group of `size` ranks at `init_method` (e.g. 'tcp://127.0.0.1:PORT').
    A single rank needs no process group."""
    group = TensorParallelGroup(rank=rank, size=size)
    if size > 1:
        dist.init_process_group(backend=backend_for(device), init_method=init_method, rank=rank,
                                world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
    return group


def destroy_tensor_parallel() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

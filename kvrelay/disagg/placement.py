"""Where `kvrelay up` runs each instance: the CPU, or which GPUs and what share of their memory.

    plan_devices(["0"], [("prefill-0", 1), ("decode-0", 1)], "cuda", 0.9)
    # both on GPU 0, each with --gpu-memory-utilization 0.45: together they stay under 0.9

A GPU child sees only its GPUs (CUDA_VISIBLE_DEVICES) and runs `--device cuda`: its ranks use
cuda:0..tp-1 of what it sees. Instances take the least-loaded GPUs in turn, so with enough GPUs each
gets its own; where instances share a GPU, each gets the requested share divided by the number of
instances on its most crowded GPU (vLLM's --gpu-memory-utilization: the fraction of the GPU's memory
that one instance may use).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """One `kvrelay serve` child's device: the environment and the flags that put it there."""

    name: str
    device: str | None  # the child's --device; None: its own default (today's CPU behaviour)
    gpus: tuple[str, ...] = ()  # CUDA_VISIBLE_DEVICES entries; () on the CPU
    gpu_memory_utilization: float | None = None  # the child's share of each of its GPUs

    @property
    def env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.gpus)} if self.gpus else {}

    @property
    def serve_args(self) -> tuple[str, ...]:
        args: tuple[str, ...] = () if self.device is None else ("--device", self.device)
        if self.gpu_memory_utilization is not None:
            args += ("--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}")
        return args

    def describe(self) -> str:
        if not self.gpus:
            return "CPU"
        label = "GPU" if len(self.gpus) == 1 else "GPUs"
        return f"{label} {','.join(self.gpus)}, gpu-memory-utilization {self.gpu_memory_utilization:g}"


def plan_devices(gpus: Sequence[str], instances: Sequence[tuple[str, int]], device: str,
                 gpu_memory_utilization: float) -> list[Placement]:
    """One Placement per (name, tensor-parallel size) in `instances`, in order. `gpus`: the GPUs
    this process sees, as CUDA_VISIBLE_DEVICES entries; `device`: auto, cpu, cuda or cuda:N (all
    instances on visible GPU N). ValueError naming the fix for a device this machine lacks or an
    instance with more ranks than GPUs."""
    name = device.strip().lower()
    if name == "cpu" or (name == "auto" and not gpus):
        return [Placement(instance, "cpu" if name == "cpu" else None) for instance, _ in instances]
    usable = _usable_gpus(gpus, name)
    for instance, tp in instances:
        if tp > len(usable):
            raise ValueError(f"{instance} has tensor-parallel size {tp}, but --device {device} gives "
                             f"{len(usable)} GPU(s) and each rank needs its own: lower --prefill-tp / "
                             "--decode-tp or make more GPUs visible")
    load = dict.fromkeys(usable, 0)  # instances on each GPU so far
    chosen: list[tuple[str, ...]] = []
    for _, tp in instances:
        least_loaded = sorted(usable, key=lambda gpu: load[gpu])[:tp]  # stable: lowest index first
        picked = tuple(gpu for gpu in usable if gpu in least_loaded)
        for gpu in picked:
            load[gpu] += 1
        chosen.append(picked)
    return [Placement(instance, "cuda", picked,
                      _share(gpu_memory_utilization, max(load[gpu] for gpu in picked)))
            for (instance, _), picked in zip(instances, chosen, strict=True)]


def startup_waves(placements: Sequence[Placement]) -> list[list[Placement]]:
    """The placements in groups to start together, in order: instances sharing a GPU one after the
    other, all others at once (on the CPU: one group). NOTE: a starting instance counts the GPU
    memory that appears while it profiles as its own (kvrelay/worker/memory.py), so a neighbour
    allocating its KV cache at that moment would shrink this one's cache or fail its start."""
    waves: list[list[Placement]] = []
    for placement in placements:
        free_of_its_gpus = (wave for wave in waves
                            if not any(set(other.gpus) & set(placement.gpus) for other in wave))
        wave = next(free_of_its_gpus, None)
        if wave is None:
            waves.append([placement])
        else:
            wave.append(placement)
    return waves


def _usable_gpus(gpus: Sequence[str], device: str) -> list[str]:
    """The GPUs `device` (auto, cuda or cuda:N) lets the cluster use."""
    match = re.fullmatch(r"(auto|cuda)(?::(\d+))?", device)
    if match is None or (match.group(1) == "auto" and match.group(2) is not None):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if not gpus:
        raise ValueError(f"device {device!r} asks for a GPU, but this machine shows none; use --device cpu")
    if match.group(2) is None:
        return list(gpus)
    index = int(match.group(2))
    if index >= len(gpus):
        raise ValueError(f"device {device!r}: this machine has {len(gpus)} GPU(s), "
                         f"cuda:0..cuda:{len(gpus) - 1}")
    return [gpus[index]]


def _share(gpu_memory_utilization: float, instances_on_gpu: int) -> float:
    """The requested share split between the instances on one GPU, rounded down (4 decimals) so
    that together they stay under it."""
    if instances_on_gpu == 1:
        return gpu_memory_utilization
    return math.floor(gpu_memory_utilization / instances_on_gpu * 10_000) / 10_000


def visible_gpus() -> list[str]:
    """The GPUs this process sees, as what a child's CUDA_VISIBLE_DEVICES would list for each
    (this process's own CUDA_VISIBLE_DEVICES entries where it has one)."""
    import torch  # NOTE: only here: `kvrelay up --device cpu` never imports torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [entry.strip() for entry in listed.split(",")] if listed else [str(i) for i in range(count)]
    return ids[:count]

"""Tensor-parallel sharding of the llama family: which heads and rows one rank owns.

Column-parallel (each rank owns a slice of the output rows): q/k/v and gate/up, biases included.
Row-parallel (each rank owns a slice of the input columns; the outputs are summed with an
all-reduce): o_proj and down_proj, which have no bias in this family. Everything else (norms,
embeddings, the LM head) is replicated; the LM head's product is vocab-parallel all the same
(each rank multiplies its share of the rows: `llama.CausalLM.compute_logits`).

KV heads follow vLLM's rule: split when `num_kv_heads % tp == 0`; replicated when
`tp % num_kv_heads == 0` (each rank keeps the one KV head its query heads read); otherwise the
model cannot be split at that size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvrelay.model.spec import ModelSpec


@dataclass(frozen=True)
class ShardLayout:
    """What one rank owns, in whole heads and rows of the unsharded model."""

    rank: int
    size: int
    q_heads: range  # query heads owned by this rank
    kv_heads: range  # KV heads owned (one head, possibly shared with other ranks, when replicated)
    intermediate: range  # rows of gate/up (and columns of down) owned
    kv_replicated: bool


def check_tensor_parallel(spec: ModelSpec, size: int) -> None:
    """Raise ValueError, naming the numbers, if `spec` cannot be split over `size` ranks."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    if spec.is_mla and size > 1:
        raise ValueError(f"tensor_parallel_size={size}: {spec.architecture} (MLA, one latent KV tensor "
                         "per layer) is not sharded yet; run it at tensor_parallel_size=1")
    if spec.num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's "
                         f"num_attention_heads={spec.num_heads}")
    kv = spec.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size={size} and num_key_value_heads={kv}: KV heads can be "
                         "split only when num_key_value_heads % tensor_parallel_size == 0, or "
                         "replicated when tensor_parallel_size % num_key_value_heads == 0")
    if spec.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's "
                         f"intermediate_size={spec.intermediate_size}")


def shard_layout(spec: ModelSpec, rank: int, size: int) -> ShardLayout:
    check_tensor_parallel(spec, size)
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} is outside a group of size {size}")
    q_per_rank = spec.num_heads // size
    kv = spec.num_kv_heads
    kv_heads = kv_heads_of_rank(kv, size, rank)
    inter = spec.intermediate_size // size
    return ShardLayout(rank=rank, size=size,
                       q_heads=range(rank * q_per_rank, (rank + 1) * q_per_rank),
                       kv_heads=kv_heads, intermediate=range(rank * inter, (rank + 1) * inter),
                       kv_replicated=kv % size != 0)


def kv_heads_of_rank(num_kv_heads: int, size: int, rank: int) -> range:
    """The KV heads rank `rank` of `size` holds: a contiguous share when `num_kv_heads % size == 0`,
    else (replicated, `size % num_kv_heads == 0`) the one head its query heads read; ranks
    [j * size/num_kv_heads, (j+1) * size/num_kv_heads) share head j. ValueError otherwise."""
    if num_kv_heads % size == 0:
        per_rank = num_kv_heads // size
        return range(rank * per_rank, (rank + 1) * per_rank)
    if size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads can be neither split nor replicated over "
                         f"tensor_parallel_size={size}")
    head = rank // (size // num_kv_heads)
    return range(head, head + 1)


def shard_spec(spec: ModelSpec, layout: ShardLayout) -> ModelSpec:
    """The spec of the model one rank runs: its heads and MLP rows only."""
    return dataclasses.replace(spec, num_heads=len(layout.q_heads), num_kv_heads=len(layout.kv_heads),
                               intermediate_size=len(layout.intermediate))


def shard_weights(weights: Mapping[str, torch.Tensor], spec: ModelSpec,
                  layout: ShardLayout) -> dict[str, torch.Tensor]:
    """Hugging Face-named full tensors -> this rank's slices (row slices are views; column slices
    of the row-parallel weights are copied, so each rank holds only its share)."""
    d = spec.head_dim
    row_ranges = {
        "q_proj": _rows(layout.q_heads, d),
        "k_proj": _rows(layout.kv_heads, d),
        "v_proj": _rows(layout.kv_heads, d),
        "gate_proj": layout.intermediate,
        "up_proj": layout.intermediate,
    }
    column_ranges = {"o_proj": _rows(layout.q_heads, d), "down_proj": layout.intermediate}
    sharded: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        proj = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if proj in row_ranges:
            rows = row_ranges[proj]
            sharded[name] = tensor[rows.start:rows.stop]  # [rows, in] or bias [rows]
        elif proj in column_ranges and name.endswith(".weight"):
            cols = column_ranges[proj]
            sharded[name] = tensor[:, cols.start:cols.stop].contiguous()  # [out, cols]
        else:
            sharded[name] = tensor
    return sharded


def _rows(heads: range, head_dim: int) -> range:
    return range(heads.start * head_dim, heads.stop * head_dim)

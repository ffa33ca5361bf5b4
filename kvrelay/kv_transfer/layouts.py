"""What the bytes of one KV block mean, by engine, and the conversions between two meanings.

The compatibility fingerprint names a block's layout (compat.py, field `layout`). Two instances
whose layouts are equal exchange blocks as bytes. Two whose layouts differ exchange them only
where a conversion below exists (a reader reads the writer's block bytes into its own block,
checks them against the writer's checksums, then rewrites them in its layout); any other pair is
refused at the handshake and the reader recomputes.

    kvrelay      per layer [num_blocks, 2, H_kv, block_size, D]: the K of every head, then the V
                 of every head, each [block_size, D] row-major
    vLLM CPU     per layer [num_blocks, H_kv, block_size, 2 * D] as vLLM registers it, but the
                 CPU_ATTN kernels (ISA "vec" and "vec16") store per head K transposed,
                 [D, block_size], then V, [block_size, D]: measured by writing known K/V through
                 vLLM's own cpu_attn_reshape_and_cache (tests/integrations/vllm/test_kv_layout.py)
    vLLM CPU     other ISAs (AMX for bfloat16, NEON, ...) pack K/V in ways not described here:
    other ISA    such a block is opaque, exchanged only with an instance of the same layout

Block bytes are equal in all of them (H_kv * block_size * 2 * D elements), so a transport moves
whole blocks whatever their layout. Conversions need equal block sizes, heads and element types
(the other fingerprint fields) and whole blocks (equal tensor_parallel_size).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KVRELAY_LAYOUT = "kv[2,Hkv,bs,D]"
VLLM_CPU_LAYOUT = "vllm-cpu[Hkv,Kt(D,bs)|V(bs,D)]"
# vLLM's CPU attention ISAs whose block interior is VLLM_CPU_LAYOUT.
_VLLM_CPU_PLAIN_ISAS = ("vec", "vec16")

_CONVERTIBLE = {(KVRELAY_LAYOUT, VLLM_CPU_LAYOUT), (VLLM_CPU_LAYOUT, KVRELAY_LAYOUT)}


def vllm_cpu_layout(isa: str) -> str:
    """The layout name of a vLLM CPU_ATTN cache written by kernels of ISA `isa`."""
    return VLLM_CPU_LAYOUT if isa in _VLLM_CPU_PLAIN_ISAS else f"vllm-cpu-{isa}[opaque]"


def can_convert(source: str, target: str) -> bool:
    """Whether a block in layout `source` can be rewritten in layout `target` (equal: trivially)."""
    return source == target or (source, target) in _CONVERTIBLE


def convert_blocks(layers: Sequence[torch.Tensor], block_ids: Sequence[int], source: str,
                   target: str) -> None:
    """Rewrite `block_ids` of every layer, in place, from layout `source` to `target`.

    `layers` are the KV tensors as kvrelay registers them, each [num_blocks, 2, H_kv, block_size,
    D] whatever the bytes mean (a vLLM cache is viewed in that shape by the adapter)."""
    if source == target or not block_ids:
        return
    if (source, target) not in _CONVERTIBLE:
        raise ValueError(f"no conversion from KV layout {source!r} to {target!r}")
    import torch

    index = torch.tensor(list(block_ids), dtype=torch.long)
    n = len(block_ids)
    for layer in layers:
        _, _, h, bs, d = layer.shape
        blocks = layer.index_select(0, index)  # [n, 2, H, bs, D] as stored (source bytes)
        if source == VLLM_CPU_LAYOUT:
            per_head = blocks.reshape(n, h, 2, bs * d)  # [n, H, K|V, bs*D]
            k = per_head[:, :, 0].reshape(n, h, d, bs).transpose(-1, -2)  # [n, H, bs, D]
            v = per_head[:, :, 1].reshape(n, h, bs, d)  # [n, H, bs, D]
            converted = torch.stack((k, v), dim=1)  # [n, 2, H, bs, D]
        else:
            k_t = blocks[:, 0].transpose(-1, -2).reshape(n, h, d * bs)  # [n, H, D*bs]: K^T per head
            v = blocks[:, 1].reshape(n, h, bs * d)  # [n, H, bs*D]
            converted = torch.stack((k_t, v), dim=2).reshape(n, 2, h, bs, d)  # vLLM bytes, kvrelay shape
        layer.index_copy_(0, index, converted)

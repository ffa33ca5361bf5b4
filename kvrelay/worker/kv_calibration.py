"""fp8 KV scales: calibrated once, at engine start, from the model itself.

Why calibrated and not computed at write time: a block written with one scale must be read with
that scale for as long as it lives, here and on every instance it is shipped to (P/D, offload).
A write-time scale would therefore be a scale per block, stored and transferred next to it (and
recomputed as a sequence grows into a block); a fixed per layer, per KV head scale is neither,
and the decode kernel applies it for free (K's scale folds into the query, V's into the output).

How: one forward pass of a fixed calibration sequence with a temporary float32 KV cache; per
layer, KV head and K/V the largest magnitude seen, times a headroom factor, over the format's
largest value, rounded UP to a power of two. Powers of two make `value / scale` exact before
fp8's own rounding, and make the result insensitive to the last-bit noise of the forward pass
(thread count, kernels), so P and D derive identical scales. Values beyond the calibrated range
saturate to the largest fp8 value (kv_format.quantize_kv) instead of becoming inf.
"""

from __future__ import annotations

import hashlib

import torch

from kvrelay.attention.forward_context import ForwardContext, set_forward_context
from kvrelay.attention.kv_format import KVFormat
from kvrelay.attention.layer import build_attention_metadata
from kvrelay.model.llama import CausalLM
from kvrelay.utils import cdiv

CALIBRATION_TOKENS = 256
HEADROOM = 1.25  # the calibration sequence's largest K/V value maps to at most max / 1.25
_SEED = 20261202


def calibration_token_ids(vocab_size: int, num_tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """A fixed token sequence: the same on every instance for the same vocabulary."""
    generator = torch.Generator().manual_seed(_SEED)
    return torch.randint(0, vocab_size, (num_tokens,), generator=generator).tolist()


@torch.inference_mode()
def calibrate_kv_scales(model: CausalLM, fmt: KVFormat, device: torch.device,
                        block_size: int = 16) -> torch.Tensor:
    """[num_layers, 2 (K, V), num_kv_heads] float32 scales for an fp8 `fmt` (see module docstring)."""
    spec = model.spec
    token_ids = calibration_token_ids(spec.vocab_size, min(CALIBRATION_TOKENS, spec.max_position_embeddings))
    num_tokens = len(token_ids)
    num_blocks = cdiv(num_tokens, block_size)
    layers = model.attention_layers()
    saved = {name: (layer.kv_cache, layer.kv_format, layer.kv_scales) for name, layer in layers.items()}
    meta = build_attention_metadata([num_tokens], [num_tokens], [list(range(num_blocks))], block_size, device)
    try:
        for layer in layers.values():
            # [num_blocks, 2, Hkv, block_size, D], float32 whatever the model's dtype
            layer.kv_cache = torch.zeros(num_blocks, 2, spec.num_kv_heads, block_size, spec.head_dim,
                                         dtype=torch.float32, device=device)
            layer.kv_scales = None
        with set_forward_context(ForwardContext(attn_metadata={name: meta for name in layers})):
            model(torch.tensor(token_ids, dtype=torch.long, device=device),
                  torch.arange(num_tokens, dtype=torch.long, device=device))
        # per layer [blocks, 2, Hkv, bs, D] -> [2, Hkv]; stacked [L, 2, Hkv]
        amax = torch.stack([layer.kv_cache.abs().amax(dim=(0, 3, 4)) for layer in layers.values()])
    finally:
        for name, layer in layers.items():
            layer.kv_cache, layer.kv_format, layer.kv_scales = saved[name]
    return scales_from_amax(amax.float().cpu(), fmt)


def scales_from_amax(amax: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """amax [...] -> the power-of-two scales that map amax * HEADROOM to at most fmt's max."""
    wanted = amax.clamp(min=1e-30) * HEADROOM / fmt.max_value
    return torch.exp2(torch.ceil(torch.log2(wanted))).to(torch.float32)


def scales_digest(scales: torch.Tensor | None) -> str:
    """A short stable digest of the scales (part of the compatibility digest); "none" without."""
    if scales is None:
        return "none"
    return hashlib.sha256(scales.to(torch.float32).contiguous().numpy().tobytes()).hexdigest()[:16]

"""The engine's KV cache format, fp8 scales and compatibility fingerprint, decided once at start."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvrelay.attention.kv_format import KVFormat, resolve_kv_format
from kvrelay.config import EngineConfig
from kvrelay.kv_transfer.compat import compat_fingerprint
from kvrelay.kv_transfer.layouts import KVRELAY_LAYOUT
from kvrelay.model.llama import build_model
from kvrelay.model.spec import ModelSpec
from kvrelay.worker.batch_invariance import numerics
from kvrelay.worker.batch_invariance import prepare as prepare_batch_invariance
from kvrelay.worker.kv_calibration import calibrate_kv_scales, scales_digest

_SAMPLE = 64  # elements per parameter in the weights fingerprint


@dataclass(frozen=True)
class KVSetup:
    format: KVFormat
    scales: torch.Tensor | None  # [num_layers, 2, num_kv_heads] float32, fp8 only
    fingerprint: dict[str, Any]  # kvrelay/kv_transfer/compat.py
    bytes_per_token: int  # KV bytes one token takes across all layers: what a transfer moves per token


def build_kv_setup(config: EngineConfig, spec: ModelSpec, weights: Mapping[str, torch.Tensor],
                   dtype: torch.dtype, device: torch.device) -> KVSetup:
    """`spec` and `weights` are the whole model's (before any tensor-parallel sharding), so every
    instance of one checkpoint, whatever its TP size, derives the same fingerprint and scales.
    The batch-invariant mode is checked and set up first: before the calibration's matmuls."""
    prepare_batch_invariance(config, spec)
    fmt = resolve_kv_format(config.cache.cache_dtype, config.model.dtype)
    if fmt.is_fp8 and spec.is_mla:
        raise ValueError(f"kv_cache_dtype {fmt.name} is not available for {spec.architecture}'s latent KV "
                         "cache (MLA); use bfloat16, float16 or float32")
    scales = None
    if fmt.is_fp8:  # calibrated on an unsharded copy of the model, dropped once the scales exist
        # NOTE: the ranks slice these [num_layers, 2, num_kv_heads] scales by the KV heads they own.
        scales = calibrate_kv_scales(build_model(spec, weights, dtype, device), fmt, device)
    policy = fmt.scales_policy if scales is None else f"{fmt.scales_policy}:{scales_digest(scales)}"
    fingerprint = compat_fingerprint(
        model=model_fingerprint(spec, weights), kv_cache_dtype=fmt.name, kv_scales=policy,
        layout=kv_layout(spec), block_size=config.cache.block_size, head_size=spec.head_dim,
        num_kv_heads=spec.num_kv_heads, numerics=numerics(config))
    per_layer = spec.head_dim if spec.is_mla else 2 * spec.num_kv_heads * spec.head_dim
    bytes_per_token = spec.num_layers * per_layer * fmt.element_size
    return KVSetup(fmt, scales, fingerprint, bytes_per_token)


def kv_layout(spec: ModelSpec) -> str:
    """The cache layout's name in the compatibility fingerprint (and KVCacheSpec.layout)."""
    if spec.is_mla:
        return f"mla[bs,{spec.kv_lora_rank}+{spec.qk_rope_head_dim}]"
    return KVRELAY_LAYOUT


def model_fingerprint(spec: ModelSpec, weights: Mapping[str, torch.Tensor]) -> str:
    """The architecture and shapes, plus a digest of a sample of every loaded weight rounded to
    bfloat16, so the same checkpoint loaded in float32 on one instance and bfloat16 on another
    matches, and two checkpoints of one architecture do not."""
    digest = hashlib.sha256()
    for name, param in sorted(weights.items()):
        sample = param.detach().reshape(-1)[:_SAMPLE].to(torch.bfloat16).view(torch.int16).cpu()
        digest.update(name.encode() + sample.numpy().tobytes())
    return (f"{spec.architecture}/L{spec.num_layers}/h{spec.hidden_size}/H{spec.num_heads}/"
            f"v{spec.vocab_size}/w{digest.hexdigest()[:16]}")

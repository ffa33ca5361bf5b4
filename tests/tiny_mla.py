"""Tiny random DeepSeek-V2/V3 models (dense layers, MLA) from transformers configs."""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvrelay.model.loader import LoadedModel
from kvrelay.model.spec import ModelSpec
from tests.tiny import TINY_VOCAB, tiny_tokenizer


def mla_config(arch: str = "deepseek_v3", **overrides: Any):  # type: ignore[no-untyped-def]
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=2, n_routed_experts=4,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=0,
        bos_token_id=None, pad_token_id=None)
    if arch == "deepseek_v3":
        common["q_lora_rank"] = 48
        return transformers.DeepseekV3Config(**{**common, **overrides})
    common["q_lora_rank"] = None
    return transformers.DeepseekV2Config(**{**common, **overrides})


@functools.lru_cache(maxsize=4)
def mla_hf_model(arch: str = "deepseek_v3", seed: int = 0):  # type: ignore[no-untyped-def]
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(mla_config(arch), attn_implementation="eager")
    return model.to(torch.float32).eval()


def tiny_mla_model(arch: str = "deepseek_v3", seed: int = 0) -> LoadedModel:
    model = mla_hf_model(arch, seed)
    spec = ModelSpec.from_hf_config(model.config.to_dict())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return LoadedModel(spec=spec, weights=weights, tokenizer=tiny_tokenizer(), name=f"tiny-{arch}",
                       source="memory")

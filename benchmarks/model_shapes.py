"""The model shapes the GPU benchmark and the GPU tests run, with random weights, and the near-zero
model of the host-overhead measurement.

The real checkpoints are too big to carry to a lent GPU, so the shapes run with random weights:
a fixed seed, projections and embeddings drawn with std 0.02 (logits stay in a sane range), norm
weights near 1. The same tensors go to kvrelay (`loaded_model`) and to transformers
(`hf_model`), so both sides compute the same function.

The shapes are the models' published config.json (the fields that set the shapes and the math;
the files were read from copies quoted in public repositories, 2026-12-04):
  SmolLM2-135M   huggingface.co/HuggingFaceTB/SmolLM2-135M/blob/main/config.json
  Llama-3.2-1B   huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json
Their bos/eos ids are kept but play no part: the benchmark runs with ignore_eos.

Only APIs that kvrelay had before the GPU work are used here (LoadedModel,
ModelSpec.from_hf_config), so the host-overhead child can run this module against an older tree.
"""

from __future__ import annotations

from typing import Any

import torch

from kvrelay.model.loader import LoadedModel
from kvrelay.model.spec import ModelSpec

SMOLLM2_135M: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "rope_scaling": None,
    "max_position_embeddings": 8192, "tie_word_embeddings": True,
    "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    "bos_token_id": 0, "eos_token_id": 0,
}

LLAMA_3_2_1B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "max_position_embeddings": 131072, "tie_word_embeddings": True,
    "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    "bos_token_id": 128000, "eos_token_id": 128001,
}

# The host-overhead model: every tensor a few bytes, so a step's time is the engine's own work.
NEAR_ZERO: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 64,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
    "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    "bos_token_id": None, "eos_token_id": 0,
}

SHAPES: dict[str, dict[str, Any]] = {"smollm2-135m": SMOLLM2_135M, "llama-3.2-1b": LLAMA_3_2_1B}
DISPLAY_NAMES = {"smollm2-135m": "SmolLM2-135M", "llama-3.2-1b": "Llama-3.2-1B"}


def shape_config(name: str, **overrides: Any) -> dict[str, Any]:
    """A copy of shape `name`'s config with `overrides` (e.g. num_hidden_layers=4)."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    return {**SHAPES[name], **overrides}


def weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every weight of a Llama config."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_rows = config["num_attention_heads"] * head_dim
    kv_rows = config["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.self_attn.q_proj.weight": (q_rows, hidden),
            f"{p}.self_attn.k_proj.weight": (kv_rows, hidden),
            f"{p}.self_attn.v_proj.weight": (kv_rows, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, q_rows),
            f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
        })
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def random_weights(config: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", std: float = 0.02) -> dict[str, torch.Tensor]:
    """Random weights of `config`'s shapes, the same for the same seed on the same device type:
    matrices N(0, std), norm weights 1 + N(0, 0.1) (not all ones, so a norm applied with the
    wrong weight shows). Drawn in float32, then cast to `dtype`."""
    generator = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        scale, offset = (0.1, 1.0) if name.endswith("norm.weight") else (std, 0.0)
        w = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        weights[name] = (w.mul_(scale).add_(offset)).to(dtype)
    return weights


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer of `vocab_size` ids ('t17' is token 17, 0 is '</s>'): the shapes'
    real tokenizers are not needed to time or compare token ids."""
    from tests.tiny import tiny_tokenizer  # the repository's one builder of it

    return tiny_tokenizer(vocab_size)


def loaded_model(config: dict[str, Any], weights: dict[str, torch.Tensor], name: str) -> LoadedModel:
    """kvrelay's in-memory model of `weights`. The dict is copied: the engine empties the one it
    is given, and the caller keeps its own for transformers."""
    spec = ModelSpec.from_hf_config(config)
    return LoadedModel(spec=spec, weights=dict(weights), tokenizer=word_tokenizer(spec.vocab_size),
                       name=name, source="memory")


def near_zero_loaded_model(seed: int = 0) -> LoadedModel:
    """The host-overhead model, float32 on the CPU (the engine moves it to its device)."""
    return loaded_model(NEAR_ZERO, random_weights(NEAR_ZERO, seed), "near-zero")


def hf_model(config: dict[str, Any], weights: dict[str, torch.Tensor],
             attn_implementation: str = "sdpa") -> Any:
    """A transformers LlamaForCausalLM holding exactly `weights` (same tensors, no copy), on their
    device and in their dtype, in eval mode."""
    import transformers

    hf_config = transformers.LlamaConfig(**hf_config_kwargs(config),
                                         attn_implementation=attn_implementation)  # type: ignore[call-arg]
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_config)
    model.load_state_dict(weights, strict=False, assign=True)
    if hf_config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # NOTE: buffers are not in the state dict: rebuild the rotary embedding off the meta device.
    device = next(iter(weights.values())).device
    model.model.rotary_emb = type(model.model.rotary_emb)(config=hf_config).to(device)
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"transformers model left without weights: {missing[:4]}")
    return model.eval()


def hf_config_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """`config` as LlamaConfig keyword arguments (architectures/model_type are the class's own)."""
    return {k: v for k, v in config.items() if k not in ("architectures", "model_type")}

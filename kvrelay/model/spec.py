"""ModelSpec: the hyper-parameters the engine needs, independent of the file format."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "deepseek_v2", "deepseek_v3")
MLA_ARCHITECTURES = ("deepseek_v2", "deepseek_v3")

# Hugging Face `architectures` / `model_type` names -> our family name.
_HF_ARCH_ALIASES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "deepseek_v2": "deepseek_v2",
    "deepseek_v3": "deepseek_v3",
}


@dataclass(frozen=True)
class ModelSpec:
    """Everything about a decoder-only model that the engine and the KV layout depend on."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    rope_scaling: dict[str, Any] | None = None  # e.g. Llama 3 {"rope_type": "llama3", ...}
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Multi-head latent attention (DeepSeek-V2/V3), kv_lora_rank > 0: the KV cache holds one latent
    # of kv_lora_rank + qk_rope_head_dim per token (num_kv_heads 1, head_dim that width).
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"kvrelay supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelSpec:
        """Build from a Hugging Face `config.json` dict (or `PretrainedConfig.to_dict()`)."""
        names = list(cfg.get("architectures") or []) + [cfg.get("model_type", "")]
        arch = next((_HF_ARCH_ALIASES[n] for n in names if n in _HF_ARCH_ALIASES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {names!r}; kvrelay supports "
                f"{', '.join(sorted(k for k in _HF_ARCH_ALIASES if 'For' in k))}"
            )
        if arch in MLA_ARCHITECTURES:
            return _mla_spec(arch, cfg)
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        rope_params = cfg.get("rope_parameters")  # newer transformers keep theta in here
        if rope_theta is None and isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta")
        if rope_scaling is None and isinstance(rope_params, dict):
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _mla_spec(arch: str, cfg: dict[str, Any]) -> ModelSpec:
    """DeepSeek-V2/V3: dense layers only (mixture-of-experts layers are refused), default RoPE."""
    layers = int(cfg["num_hidden_layers"])
    if cfg.get("n_routed_experts") and int(cfg.get("first_k_dense_replace") or 0) < layers:
        raise ValueError(f"{arch}: mixture-of-experts layers are not supported (first_k_dense_replace "
                         f"{cfg.get('first_k_dense_replace')} < {layers} layers); only dense DeepSeek "
                         "models run here")
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"{arch}: RoPE scaling {rope.get('rope_type', rope.get('type'))!r} is not supported")
    theta = cfg.get("rope_theta") or (rope.get("rope_theta") if isinstance(rope, dict) else None) or 10000.0
    eos = cfg.get("eos_token_id")
    kv_lora_rank, rope_dim = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
    return ModelSpec(
        architecture=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]), num_layers=layers,
        num_heads=int(cfg["num_attention_heads"]), num_kv_heads=1, head_dim=kv_lora_rank + rope_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)), bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        kv_lora_rank=kv_lora_rank, q_lora_rank=cfg.get("q_lora_rank"),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=rope_dim,
        v_head_dim=int(cfg["v_head_dim"]), rope_interleave=bool(cfg.get("rope_interleave", True)))

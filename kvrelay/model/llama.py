"""The llama family: Llama (SmolLM2, Llama 3), Qwen2 (bias on q/k/v), Qwen3 (RMSNorm on q and k).

Module names follow Hugging Face, except that q/k/v and gate/up are fused into `qkv_proj` and
`gate_up_proj` at load time (one matmul instead of three, or two). `load_weights` takes Hugging
Face tensor names; projections that already lie back to back in one storage, in the fused order
(as the loader's conversion cache stores them), become one view of it instead of a copy.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from kvrelay.attention.layer import Attention
from kvrelay.distributed.parallel_state import TensorParallelGroup
from kvrelay.model.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, apply_rotary_
from kvrelay.model.sharding import shard_layout, shard_spec, shard_weights
from kvrelay.model.spec import ModelSpec
from kvrelay.utils import cdiv

# Fused parameter -> the Hugging Face projections stacked (along dim 0) into it.
_FUSED_SOURCES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# Our parameter name -> ([(Hugging Face source name, its expected shape)], our shape).
WeightPlan = dict[str, tuple[list[tuple[str, tuple[int, ...]]], tuple[int, ...]]]
# Tensors some checkpoints carry that we recompute instead.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def fusion_group_of(name: str) -> tuple[str, ...] | None:
    """The Hugging Face tensors fused together with `name`, in fused order; None if it is not fused.
    "model.layers.0.mlp.up_proj.weight" -> ("model.layers.0.mlp.gate_proj.weight", "...up_proj.weight")"""
    module_name, _, leaf = name.rpartition(".")
    parent, _, proj = module_name.rpartition(".")
    for sources in _FUSED_SOURCES.values():
        if proj in sources:
            return tuple(f"{parent}.{src}.{leaf}" for src in sources)
    return None


class SelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias)
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=False)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.attn = Attention(
            f"model.layers.{layer_idx}.self_attn.attn",
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            scale=spec.head_dim**-0.5,
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, (H + 2*Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)  # [T, H*D], [T, Hkv*D] x2
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q.view(num_tokens, h, d)), self.k_norm(k.view(num_tokens, hkv, d))
            qk = torch.cat((q, k), dim=1)  # [T, H + Hkv, D]
        else:
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, h + hkv, d)  # [T, H + Hkv, D]
        apply_rotary_(qk, cos, sin)  # [T, H + Hkv, D], q and k roped together, in place
        out = self.attn(qk[:, :h].flatten(1), qk[:, h:].flatten(1), v)  # [T, H*D]
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp  # o_proj and down_proj are row-parallel: their outputs are summed over ranks
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = SelfAttention(spec, layer_idx)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous layer's MLP output (the embeddings for layer 0, with residual None);
        residual: the residual stream before it. Returns this layer's MLP output and the stream,
        which the next layer adds together: each add is fused with the norm that follows it."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x = self.input_layernorm.add_and_norm(h, residual)
        attn_out = self.tp.all_reduce(self.self_attn(x, cos, sin))  # [T, hidden]
        x = self.post_attention_layernorm.add_and_norm(attn_out, residual)
        return self.tp.all_reduce(self.mlp(x)), residual


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, tp) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope_theta, spec.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, h.dtype)  # [T, 1, D] each, shared by all layers
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin)
        if residual is None:  # no layers
            return self.norm(h)
        return self.norm.add_and_norm(h, residual)


class CausalLM(nn.Module):
    """`spec` is the model one rank runs (its share of the heads and MLP rows under TP)."""

    def __init__(self, spec: ModelSpec, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp or TensorParallelGroup.single()
        self.model = LlamaModel(spec, self.tp)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] float32, on rank 0; None on the other ranks. Every rank must
        call it with the same rows (it is a collective above TP 1).

        NOTE: vocab-parallel above TP 1: each rank multiplies its share of the LM head's rows
        (a view of the replicated weight, so no extra memory) and rank 0 gathers the logits.
        At TP 2 on the 2-core VM that took 0.56-0.67x the time of rank 0 computing them all at
        1 and 16 rows in three of four runs (1.01-1.04x in the most loaded one) and 0.82-1.35x
        at 64 (`benchmarks/bench_tp.py --rows vocab`); decode samples few rows a step. The
        embedding stays replicated: a lookup took a third to a ninth of a vocab-parallel one's
        time (which needs an all-reduce)."""
        tp, weight, matmul = self.tp, self.lm_head.weight, self.lm_head.matmul
        if tp.size == 1:
            return matmul(hidden, weight, None).float()
        vocab = weight.shape[0]
        share = cdiv(vocab, tp.size)
        lo, hi = min(vocab, tp.rank * share), min(vocab, (tp.rank + 1) * share)
        local = matmul(hidden, weight[lo:hi], None).float()  # [N, hi - lo]
        if hi - lo < share:  # the last rank's share is short when vocab % tp != 0
            local = torch.nn.functional.pad(local, (0, share - (hi - lo)))
        logits = tp.gather_to_first(local)  # [N, tp * share] on rank 0
        return logits[:, :vocab] if logits is not None else None

    def attention_layers(self) -> dict[str, Attention]:
        """Attention modules by layer name, in layer order."""
        return {m.layer_name: m for m in self.modules() if isinstance(m, Attention)}

    def load_weights(self, weights: Mapping[str, torch.Tensor], device: torch.device | None = None) -> None:
        """Load Hugging Face-named tensors. Strict: a missing, unexpected or wrongly shaped tensor
        raises ValueError naming it, before anything is changed. Each parameter keeps its current
        dtype; it lands on `device` (default: where the parameter is, or the CPU for a meta model).
        Tensors already in the right dtype and device are used in place, not copied: unfused ones
        always, fused ones when their sources lie back to back in one storage."""
        plan = self._weight_plan()
        _check_names_and_shapes(plan, weights, tied=self.spec.tie_word_embeddings)
        for name, (sources, shape) in plan.items():
            module_name, _, leaf = name.rpartition(".")
            module = self.get_submodule(module_name)
            old = getattr(module, leaf)
            target = device if device is not None else old.device
            if target.type == "meta":
                target = torch.device("cpu")
            tensor = _materialize([weights[src] for src, _ in sources], shape, old.dtype, target)
            setattr(module, leaf, nn.Parameter(tensor, requires_grad=False))
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # shared storage, no copy
        rotary = self.model.rotary
        rotary.inv_freq = rotary.inv_freq.to(self.model.embed_tokens.weight.device)

    def _weight_plan(self) -> WeightPlan:
        plan: WeightPlan = {}
        for name, param in self.named_parameters(remove_duplicate=False):
            if name == "lm_head.weight" and self.spec.tie_word_embeddings:
                continue
            shape = tuple(param.shape)
            module_name, _, leaf = name.rpartition(".")
            parent, _, proj = module_name.rpartition(".")
            if proj not in _FUSED_SOURCES:
                plan[name] = ([(name, shape)], shape)
                continue
            spec = self.spec
            kv_rows = spec.num_kv_heads * spec.head_dim
            rows = (
                (spec.num_heads * spec.head_dim, kv_rows, kv_rows)
                if proj == "qkv_proj"
                else (shape[0] // 2,) * 2
            )
            sources = [
                (f"{parent}.{src}.{leaf}", (r, *shape[1:]))
                for src, r in zip(_FUSED_SOURCES[proj], rows, strict=True)
            ]
            plan[name] = (sources, shape)
        return plan


def _check_names_and_shapes(plan: WeightPlan, weights: Mapping[str, torch.Tensor], tied: bool) -> None:
    expected = {src: shape for sources, _ in plan.values() for src, shape in sources}
    missing = [name for name in expected if name not in weights]
    if missing:
        raise ValueError(f"missing weight(s): {_some(missing)}")
    ignorable = {"lm_head.weight"} if tied else set()
    unexpected = [
        name
        for name in weights
        if name not in expected and name not in ignorable and not name.endswith(_IGNORED_SUFFIXES)
    ]
    if unexpected:
        raise ValueError(f"unexpected weight(s): {_some(unexpected)}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"weight {name} has shape {tuple(weights[name].shape)}, expected {shape}")


def _some(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _materialize(
    sources: list[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if len(sources) == 1:
        return sources[0].to(device=device, dtype=dtype).contiguous()  # no copy when already right
    if _back_to_back(sources, dtype, device):
        first = sources[0]
        return first.as_strided(shape, torch.empty(shape, device="meta").stride(), first.storage_offset())
    fused = torch.empty(shape, dtype=dtype, device=device)
    row = 0
    for src in sources:  # copy_ converts dtype/device in one pass, without a temporary
        fused[row : row + src.shape[0]].copy_(src)
        row += src.shape[0]
    return fused


def _back_to_back(sources: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `sources` (already `dtype`, on `device`) are consecutive pieces of one storage."""
    first = sources[0]
    storage_ptr = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for src in sources:
        if (src.dtype != dtype or src.device != device or not src.is_contiguous()
                or src.untyped_storage().data_ptr() != storage_ptr or src.storage_offset() != offset):
            return False
        offset += src.numel()
    return True


def build_model(
    spec: ModelSpec, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
    tp: TensorParallelGroup | None = None,
) -> CausalLM:
    """Build on the meta device (no memory), then load the weights in place. `spec` and `weights`
    are the whole model's; under tensor parallelism (`tp.size > 1`) this rank keeps its shard."""
    tp = tp or TensorParallelGroup.single()
    if spec.is_mla:  # DeepSeek-V2/V3: another family with its own module
        if tp.size > 1:
            raise ValueError(f"{spec.architecture} (MLA) runs at tensor_parallel_size=1 only, got {tp.size}")
        from kvrelay.model.deepseek import build_deepseek
        return build_deepseek(spec, weights, dtype, device)  # type: ignore[return-value]
    if tp.size > 1:
        layout = shard_layout(spec, tp.rank, tp.size)
        spec, weights = shard_spec(spec, layout), shard_weights(weights, spec, layout)
    with torch.device("meta"):
        model = CausalLM(spec, tp)
    model.to(dtype=dtype)
    model.load_weights(weights, device=device)
    return model.eval()

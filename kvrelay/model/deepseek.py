"""DeepSeek-V2/V3 with multi-head latent attention (MLA), dense MLP layers.

MLA caches, per token and layer, ONE latent vector instead of K and V per head: the normalized
compressed KV `c_kv` (kv_lora_rank) followed by the roped shared key `k_rot` (qk_rope_head_dim).
The paged cache of a layer is [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]: one
tensor, no K/V split, every head reads the same latent. Attention expands the context's latents
into per-head keys and values (`kv_b_proj`) when it reads them.

Module and parameter names follow Hugging Face's, so a checkpoint's state dict loads as it is.
Mixture-of-experts layers (`first_k_dense_replace` < layers) are not supported: refused at load.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.attention.forward_context import get_forward_context
from kvrelay.attention.kv_format import KVFormat, kv_format
from kvrelay.attention.layer import AttentionMetadata
from kvrelay.distributed.parallel_state import TensorParallelGroup
from kvrelay.model.layers import RMSNorm
from kvrelay.model.spec import ModelSpec


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[T] positions -> cos, sin [T, 1, dim / 2] (one angle per rotated pair), float32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # [dim / 2]
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, dim / 2]
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [T, heads, dim]: pairs (x0, x1), (x2, x3), ... (interleave, DeepSeek's layout) or halves
    (x_i, x_{i + dim/2}) rotated by their angle; returns a new tensor in x's dtype."""
    xf = x.float()
    if interleave:
        first, second = xf[..., 0::2], xf[..., 1::2]  # [T, heads, dim / 2] each
    else:
        first, second = xf.chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)  # [T, heads, dim]
    return rotated.to(x.dtype)


class MLAAttention(nn.Module):
    """Attention over the latent cache; the connector hooks as in kvrelay/attention/layer.py."""

    def __init__(self, layer_name: str, spec: ModelSpec, kv_b_proj: nn.Linear, scale: float) -> None:
        super().__init__()
        self.layer_name = layer_name
        self.num_heads = spec.num_heads
        self.kv_lora_rank, self.rope_dim = spec.kv_lora_rank, spec.qk_rope_head_dim
        self.nope_dim, self.v_dim = spec.qk_nope_head_dim, spec.v_head_dim
        self.scale = scale
        self.kv_b_proj = [kv_b_proj]  # a list: the projection is the parent's parameter, not ours
        # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]; assigned by the model runner.
        self.kv_cache: torch.Tensor = torch.empty(0)
        self.kv_format: KVFormat = kv_format("float32")
        self.kv_scales: torch.Tensor | None = None  # fp8 is not offered for MLA

    def forward(self, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        """q [T, H, nope + rope] (roped), latent [T, kv_lora_rank + rope] -> [T, H * v_head_dim]."""
        ctx = get_forward_context()
        meta: AttentionMetadata = ctx.attn_metadata[self.layer_name]
        ctx.kv_connector.wait_for_layer_load(self.layer_name)
        flat = self.kv_cache.view(-1, self.kv_cache.shape[-1])  # [num_blocks * bs, latent]
        flat[meta.slot_mapping] = latent.to(self.kv_cache.dtype)
        out = q.new_empty(q.shape[0], self.num_heads * self.v_dim)  # [T, H * Dv]
        for i in range(len(meta.seq_lens)):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            if end > start:
                context = self._context(meta, i, latent[start:end])  # [S, latent]
                out[start:end] = self._attend(q[start:end], context, meta.seq_lens[i])
        ctx.kv_connector.save_kv_layer(self.layer_name, self.kv_cache, meta)
        return out

    def _context(self, meta: AttentionMetadata, i: int, fresh: torch.Tensor) -> torch.Tensor:
        """Sequence i's whole context of latents [S, latent] in the compute dtype."""
        seq_len, query_len = meta.seq_lens[i], meta.query_start_loc[i + 1] - meta.query_start_loc[i]
        if seq_len == query_len:  # nothing cached before this step
            return fresh
        block_ids = self._block_ids(meta, i)
        blocks = self.kv_cache.index_select(0, block_ids)  # [nb, bs, latent]
        return blocks.flatten(0, 1)[:seq_len].to(fresh.dtype)  # [S, latent]

    @staticmethod
    def _block_ids(meta: AttentionMetadata, i: int) -> torch.Tensor:
        if meta.query_start_loc[i + 1] - meta.query_start_loc[i] == 1 and meta.decode is not None:
            row = meta.decode.token_index
            rows = list(range(row.start, row.stop)) if isinstance(row, slice) else row.tolist()
            index = rows.index(meta.query_start_loc[i])
            return meta.decode.block_ids.view(meta.decode.num_seqs, -1)[index]
        seq = next(s for s in meta.prefills if s.start == meta.query_start_loc[i])
        assert seq.block_ids is not None
        return seq.block_ids

    def _attend(self, q: torch.Tensor, context: torch.Tensor, seq_len: int) -> torch.Tensor:
        """q [Tq, H, nope + rope], context [S, latent] -> [Tq, H * Dv], causal at the end."""
        h, tq = self.num_heads, q.shape[0]
        c_kv, k_rot = context.split([self.kv_lora_rank, self.rope_dim], dim=-1)  # [S, r], [S, rope]
        kv = F.linear(c_kv, self.kv_b_proj[0].weight).view(seq_len, h, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # [S, H, nope], [S, H, Dv]
        k = torch.cat((k_nope, k_rot[:, None, :].expand(seq_len, h, self.rope_dim)), dim=-1)  # [S, H, Dqk]
        query_pos = torch.arange(seq_len - tq, seq_len)[:, None]  # [Tq, 1]
        mask = torch.arange(seq_len)[None, :] <= query_pos  # [Tq, S]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask, scale=self.scale)  # [1, H, Tq, Dv]
        return out[0].transpose(0, 1).reshape(tq, h * self.v_dim)


class DeepseekAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.spec = spec
        h, qk_dim = spec.num_heads, spec.qk_nope_head_dim + spec.qk_rope_head_dim
        if spec.q_lora_rank is None:
            self.q_proj = nn.Linear(spec.hidden_size, h * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(spec.hidden_size, spec.q_lora_rank, bias=spec.attention_bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, spec.rms_norm_eps)
            self.q_b_proj = nn.Linear(spec.q_lora_rank, h * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(spec.hidden_size, spec.kv_lora_rank + spec.qk_rope_head_dim,
                                            bias=spec.attention_bias)
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, spec.rms_norm_eps)
        self.kv_b_proj = nn.Linear(spec.kv_lora_rank, h * (spec.qk_nope_head_dim + spec.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(h * spec.v_head_dim, spec.hidden_size, bias=spec.attention_bias)
        self.attn = MLAAttention(f"model.layers.{layer_idx}.self_attn.attn", spec, self.kv_b_proj,
                                 scale=qk_dim**-0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        spec, tokens = self.spec, x.shape[0]
        if spec.q_lora_rank is None:
            q = self.q_proj(x)  # [T, H * (nope + rope)]
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(tokens, spec.num_heads, -1)  # [T, H, nope + rope]
        q_nope, q_rot = q.split([spec.qk_nope_head_dim, spec.qk_rope_head_dim], dim=-1)
        c_kv, k_rot = self.kv_a_proj_with_mqa(x).split([spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
        q_rot = apply_rope(q_rot, cos, sin, spec.rope_interleave)  # [T, H, rope]
        k_rot = apply_rope(k_rot[:, None, :], cos, sin, spec.rope_interleave)[:, 0]  # [T, rope]
        latent = torch.cat((self.kv_a_layernorm(c_kv), k_rot), dim=-1)  # [T, kv_lora_rank + rope]
        out = self.attn(torch.cat((q_nope, q_rot), dim=-1), latent)  # [T, H * Dv]
        return self.o_proj(out)


class DeepseekMLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DeepseekLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = DeepseekAttention(spec, layer_idx)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = DeepseekMLP(spec)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekBody(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DeepseekLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    """The CausalLM interface of kvrelay/model/llama.py for DeepSeek-V2/V3 (dense layers)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.tp = TensorParallelGroup.single()  # MLA runs unsharded (kvrelay/model/sharding.py)
        self.model = DeepseekBody(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden]."""
        h = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = rope_cos_sin(positions, self.spec.qk_rope_head_dim, self.spec.rope_theta)
        for layer in self.model.layers:
            h = layer(h, cos, sin)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return self.lm_head(hidden).float()

    def attention_layers(self) -> dict[str, MLAAttention]:
        return {m.layer_name: m for m in self.modules() if isinstance(m, MLAAttention)}


def build_deepseek(spec: ModelSpec, weights: Mapping[str, torch.Tensor], dtype: torch.dtype,
                   device: torch.device) -> DeepseekForCausalLM:
    model = DeepseekForCausalLM(spec)
    state = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    if spec.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"DeepSeek weights do not match the model: missing {sorted(missing)[:8]}, "
                         f"unexpected {sorted(unexpected)[:8]}")
    return model.to(device=device, dtype=dtype).eval()

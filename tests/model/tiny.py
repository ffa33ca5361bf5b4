"""Tiny random Hugging Face models and a hand-driven stand-in for the model runner.

`PagedDriver` plays the runner: it owns the KV tensors, hands out block ids from a shuffled free
list (so block ids are never contiguous), builds the attention metadata and sets the forward
context, so tests can drive any batch shape through `CausalLM` and compare with transformers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from kvrelay.attention.forward_context import ForwardContext, set_forward_context
from kvrelay.attention.layer import build_attention_metadata
from kvrelay.kv_transfer.protocols import NULL_WORKER_CONNECTOR, LayerHooks
from kvrelay.model.llama import CausalLM, build_model
from kvrelay.model.spec import ModelSpec

VOCAB = 128
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
# name -> (config class name, overrides)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama3-rope": ("LlamaConfig", {"rope_parameters": LLAMA3_ROPE}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 24}),
}


def hf_tiny_model(family: str, seed: int = 0) -> Any:
    """A transformers model with random weights large enough that attention is far from uniform."""
    import transformers

    config_cls, overrides = FAMILIES[family]
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.3 if param.dim() == 1 else 0.15)
    return model.float().eval()


def build_from_hf(hf_model: Any) -> CausalLM:
    spec = ModelSpec.from_hf_config(hf_model.config.to_dict())
    weights = {name: t.detach().clone() for name, t in hf_model.state_dict().items()}
    return build_model(spec, weights, torch.float32, torch.device("cpu"))


def hf_logits(hf_model: Any, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits for every position of `token_ids`: [len, vocab]."""
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


@dataclass
class Seq:
    token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0


class PagedDriver:
    """Runs CausalLM one step at a time on hand-assigned paged KV blocks."""

    def __init__(self, model: CausalLM, block_size: int = 4, num_blocks: int = 64, seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        spec = model.spec
        self.layers = model.attention_layers()
        for attn in self.layers.values():
            attn.kv_cache = torch.zeros(num_blocks, 2, spec.num_kv_heads, block_size, spec.head_dim)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.seqs: dict[str, Seq] = {}

    def add(
        self, seq_id: str, token_ids: list[int], shared_prefix_of: str | None = None, shared_blocks: int = 0
    ) -> Seq:
        """A new sequence; optionally its first `shared_blocks` blocks are another's (prefix hit)."""
        seq = Seq(list(token_ids))
        if shared_prefix_of is not None:
            seq.block_ids = self.seqs[shared_prefix_of].block_ids[:shared_blocks]
            seq.num_computed = shared_blocks * self.block_size
        self.seqs[seq_id] = seq
        return seq

    def step(
        self, work: list[tuple[str, int]], connector: LayerHooks = NULL_WORKER_CONNECTOR
    ) -> list[torch.Tensor]:
        """Compute `num_tokens` more tokens of each listed sequence in ONE flat batch.
        Returns each sequence's logits for the tokens computed, [num_tokens, vocab]."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        for seq_id, num_tokens in work:
            seq = self.seqs[seq_id]
            start, end = seq.num_computed, seq.num_computed + num_tokens
            while len(seq.block_ids) * self.block_size < end:
                seq.block_ids.append(self.free_blocks.pop())
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            query_lens.append(num_tokens)
            seq_lens.append(end)
            tables.append(list(seq.block_ids))
            seq.num_computed = end
        meta = build_attention_metadata(query_lens, seq_lens, tables, self.block_size, torch.device("cpu"))
        context = ForwardContext(attn_metadata={name: meta for name in self.layers}, kv_connector=connector)
        with torch.inference_mode(), set_forward_context(context):
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions))
            logits = self.model.compute_logits(hidden)
        return list(logits.split(query_lens))

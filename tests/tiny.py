"""Tiny random models built from transformers configs, packaged as kvrelay LoadedModels."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import tokenizers
import torch

from kvrelay.model.loader import LoadedModel
from kvrelay.model.spec import ModelSpec
from kvrelay.model.tokenizer import Tokenizer

TINY_VOCAB = 256


def tiny_tokenizer(vocab_size: int = TINY_VOCAB) -> Tokenizer:
    """A word-level tokenizer: 't17' is token 17; token 0 is the eos '</s>'."""
    vocab = {"</s>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t1"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    backend.add_special_tokens(["</s>"])
    return Tokenizer(backend, eos_token_id=0)


def hf_config(arch: str = "llama", **overrides: Any):  # type: ignore[no-untyped-def]
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=0, bos_token_id=None,
        pad_token_id=None)
    common.update(overrides)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        common.setdefault("head_dim", 16)
        return transformers.Qwen3Config(**common)
    raise ValueError(arch)


@functools.lru_cache(maxsize=8)
def _hf_model(arch: str, seed: int, overrides: tuple[tuple[str, Any], ...]):  # type: ignore[no-untyped-def]
    import transformers

    torch.manual_seed(seed)
    cfg = hf_config(arch, **dict(overrides))
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = model.to(torch.float32).eval()
    return model


def hf_model(arch: str = "llama", seed: int = 0, **overrides: Any):  # type: ignore[no-untyped-def]
    return _hf_model(arch, seed, tuple(sorted(overrides.items())))


def tiny_loaded_model(arch: str = "llama", seed: int = 0, **overrides: Any) -> LoadedModel:
    model = hf_model(arch, seed, **overrides)
    spec = ModelSpec.from_hf_config(model.config.to_dict())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return LoadedModel(spec=spec, weights=weights, tokenizer=tiny_tokenizer(), name=f"tiny-{arch}",
                       source="memory")


def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and the log-probability of each, one full forward per step."""
    seq = list(prompt)
    logprobs = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            tok = int(torch.argmax(logits))
            seq.append(tok)
            logprobs.append(float(lp[tok]))
    return seq[len(prompt):], logprobs


# Words of the tiny vocabulary around each message; unknown words become "t1".
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}t2 {{ message['role'] }} {{ message['content'] }} t3 {% endfor %}"
    "{% if add_generation_prompt %}t4{% endif %}")


def write_tiny_model_dir(path: str | Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random model as a Hugging Face directory (config.json, model.safetensors,
    tokenizer.json + tokenizer_config.json with a chat template) that `kvrelay serve DIR` loads."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = hf_model(arch, seed, **overrides)
    model.config.save_pretrained(str(path))
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
              str(path / "model.safetensors"))
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save(path)
    return path

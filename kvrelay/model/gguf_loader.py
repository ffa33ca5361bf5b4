"""Read a GGUF file (llama.cpp's format): hyper-parameters, weights and tokenizer.

GGUF keeps everything in one file: metadata under llama.cpp's key names (`llama.block_count`,
`tokenizer.ggml.tokens`, ...) and tensors, often quantized, under llama.cpp's tensor names
(`blk.3.attn_q.weight`). This module turns those into a `ModelSpec`, float32 tensors under Hugging
Face names, and a `Tokenizer`, undoing the two transforms llama.cpp's converter applies:

- dims are stored fastest-first, so a torch shape is the GGUF shape reversed;
- for the `llama` architecture, the rows of q/k projections are permuted from Hugging Face's
  rotate-half RoPE layout to llama.cpp's interleaved-pairs layout. Qwen2/Qwen3 use NEOX-style RoPE
  in llama.cpp and are written unpermuted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from kvrelay.model.spec import SUPPORTED_ARCHITECTURES, ModelSpec
from kvrelay.model.tokenizer import Tokenizer

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors llama.cpp adds that are not weights of the Hugging Face model (folded into ModelSpec).
_SKIPPED_TENSORS = {"rope_freqs.weight"}

# Pre-tokenizer split patterns, by `tokenizer.ggml.pre`: the regex the vocabulary's merges were
# learned on. Each is a list applied in order (llama.cpp's convention).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_PRE_TOKENIZER_SPLITS = {
    "smollm": [r"\p{N}", _GPT2_SPLIT],  # every digit is its own word
    "gpt-2": [_GPT2_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT],
    "llama3": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT],
}
# llama.cpp looks a whole word up in the vocabulary before merging, for Llama 3's vocabulary only.
_IGNORE_MERGES = {"llama-bpe", "llama3"}
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def open_gguf(path: str | Path) -> GGUFReader:
    """A reader over `path`; FileNotFoundError / ValueError name the path and the problem."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # gguf raises whatever numpy or struct raise on garbage
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e
    for tensor in reader.tensors:
        if tensor.data.nbytes != tensor.n_bytes:
            raise ValueError(f"{path} is truncated: tensor {tensor.name} is cut short")
    return reader


def field_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def architecture_of(reader: GGUFReader, path: str | Path) -> str:
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported architecture {arch!r}; "
            f"kvrelay supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return str(arch)


def spec_from_gguf(reader: GGUFReader, path: str | Path) -> ModelSpec:
    arch = architecture_of(reader, path)

    def hparam(name: str, default: Any = None) -> Any:
        value = field_value(reader, f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{path}: metadata key {arch}.{name} is missing")
        return value

    tensor_names = {t.name for t in reader.tensors}
    hidden = int(hparam("embedding_length"))
    num_heads = int(hparam("attention.head_count"))
    head_dim = int(hparam("attention.key_length", hidden // num_heads))
    rope_theta = float(hparam("rope.freq_base", 10000.0))
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens.data) if tokens is not None else int(hparam("vocab_size"))
    return ModelSpec(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(hparam("feed_forward_length")),
        num_layers=int(hparam("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(hparam("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(hparam("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        max_position_embeddings=int(hparam("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
        qk_norm=arch == "qwen3" or "blk.0.attn_q_norm.weight" in tensor_names,
        rope_scaling=_rope_scaling(reader, arch, head_dim, rope_theta),
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def _rope_scaling(reader: GGUFReader, arch: str, head_dim: int, theta: float) -> dict[str, Any] | None:
    """RoPE scaling as a Hugging Face `rope_scaling` dict, from metadata or `rope_freqs`."""
    kind = field_value(reader, f"{arch}.rope.scaling.type")
    if kind in ("linear", "yarn"):
        scaling: dict[str, Any] = {
            "rope_type": kind,
            "factor": float(field_value(reader, f"{arch}.rope.scaling.factor")),
        }
        original = field_value(reader, f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for key in ("beta_fast", "beta_slow"):
            value = field_value(reader, f"{arch}.rope.scaling.yarn_{key}")
            if value is not None:
                scaling[key] = float(value)
        return scaling
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    return llama3_scaling_from_factors(np.asarray(freqs.data, dtype=np.float64), head_dim, theta)


def llama3_scaling_from_factors(factors: np.ndarray, head_dim: int, theta: float) -> dict[str, Any] | None:
    """Recover Llama 3 `rope_scaling` from the per-frequency divisors llama.cpp bakes into `rope_freqs`.

    Llama 3 divides each inverse frequency by 1 (short wavelengths), by `factor` (long ones), or
    by a blend whose weight is linear in 1/wavelength in between. Only the ratios
    original_ctx/low_freq_factor and original_ctx/high_freq_factor matter, so we fix
    low_freq_factor = 1 and solve for the other two from the blended dims.
    """
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    inv_wavelen = inv_freq / (2 * math.pi)
    smooth = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)  # 1 = unscaled, 0 = full factor
    blended = np.flatnonzero((factors > 1.0 + 1e-4) & (factors < factor - 1e-4))
    if len(blended) < 2:
        raise ValueError("rope_freqs has too few blended frequencies to recover Llama 3 rope scaling")
    slope, intercept = np.polyfit(inv_wavelen[blended], smooth[blended], 1)  # smooth = a/λ + b
    span = -1.0 / intercept  # high_freq_factor - low_freq_factor, with low_freq_factor = 1
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": round(1.0 + span, 4),
        "original_max_position_embeddings": int(round(slope * span)),
    }


def hf_tensor_name(gguf_name: str) -> str | None:
    """Hugging Face name for a llama.cpp tensor name; None for tensors that are not weights."""
    if gguf_name in _SKIPPED_TENSORS:
        return None
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[stem]}.{suffix}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}.{suffix}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}: kvrelay does not know where it belongs")


def tensor_layout(reader: GGUFReader) -> list[tuple[ReaderTensor, str, tuple[int, ...]]]:
    """(GGUF tensor, Hugging Face name, torch shape) for every weight, in file order."""
    layout = []
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is not None:
            layout.append((tensor, name, tuple(int(d) for d in reversed(tensor.shape))))
    return layout


def iter_tensors(reader: GGUFReader, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, float32 tensor) one at a time, so at most one is held here."""
    for tensor, name, shape in tensor_layout(reader):
        weights = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weights = weights.reshape(shape)
        if spec.architecture == "llama" and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            num_heads = spec.num_heads if ".q_proj." in name else spec.num_kv_heads
            weights = _unpermute_rope_rows(weights, num_heads)
        if not weights.flags.writeable or not weights.flags.c_contiguous:  # F32 tensors are file views
            weights = np.ascontiguousarray(weights).copy()
        yield name, torch.from_numpy(weights)


def _unpermute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, (pairs, 2) -> (2, pairs), i.e. back to rotate-half."""
    rows = weights.shape[0]
    per_head = weights.reshape(num_heads, rows // num_heads // 2, 2, *weights.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2)).reshape(weights.shape)


def tokenizer_from_gguf(reader: GGUFReader, path: str | Path) -> Tokenizer:
    model = field_value(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"{path}: tokenizer model {model!r} is not supported; kvrelay reads byte-level BPE ('gpt2') only"
        )
    pre = field_value(reader, "tokenizer.ggml.pre", "gpt-2")
    if pre not in _PRE_TOKENIZER_SPLITS:
        raise ValueError(
            f"{path}: pre-tokenizer {pre!r} is not supported; "
            f"known: {', '.join(sorted(_PRE_TOKENIZER_SPLITS))}"
        )
    tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens")
    merges: list[str] = field_value(reader, "tokenizer.ggml.merges") or []
    token_types: list[int] = field_value(reader, "tokenizer.ggml.token_type") or []
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    backend = BackendTokenizer(
        models.BPE(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=[_merge_pair(m) for m in merges],
            ignore_merges=pre in _IGNORE_MERGES,
        )
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in _PRE_TOKENIZER_SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_end|>) and user-defined ones (<think>) are matched whole in text.
    typed = list(zip(tokens, token_types, strict=False))
    control = [t for t, kind in typed if kind == _TOKEN_TYPE_CONTROL]
    user_defined = [t for t, kind in typed if kind == _TOKEN_TYPE_USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
    _set_sequence_wrapping(reader, backend, tokens, bos, eos)
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_id=eos,
        chat_template=field_value(reader, "tokenizer.chat_template"),
    )


def _merge_pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _set_sequence_wrapping(
    reader: GGUFReader, backend: BackendTokenizer, tokens: list[str], bos: int | None, eos: int | None
) -> None:
    """BOS/EOS added by `encode(..., add_special_tokens=True)`, as the file's flags say."""
    add_bos = bool(field_value(reader, "tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(field_value(reader, "tokenizer.ggml.add_eos_token", False)) and eos is not None
    if not (add_bos or add_eos):
        return
    prefix = [tokens[bos]] if add_bos and bos is not None else []
    suffix = [tokens[eos]] if add_eos and eos is not None else []
    specials = [(tokens[i], i) for i in {bos, eos} if i is not None and (tokens[i] in prefix + suffix)]
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join(prefix + ["$A"] + suffix),
        pair=" ".join(prefix + ["$A"] + suffix + prefix + ["$B:1"] + suffix),
        special_tokens=specials,
    )

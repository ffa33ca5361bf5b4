"""Model loading: GGUF (checked against transformers), Hugging Face directories, the disk cache."""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvrelay.model import gguf_loader, loader
from kvrelay.model.loader import default_model_path, load_model
from kvrelay.model.spec import ModelSpec

# ----- helpers ---------------------------------------------------------------------------------


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: per head, rotate-half rows -> interleaved pairs."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_TINY_DIMS = (32, 4, 2, 8, 64, 2)  # hidden, heads, kv_heads, head_dim, ffn, layers


def _add_tiny_metadata(writer: gguf.GGUFWriter, tokens: list[str]) -> None:
    """Hyper-parameters, tokenizer and chat template of the tiny GGUF."""
    hidden, heads, kv_heads, head_dim, ffn, layers = _TINY_DIMS
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * 256)
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")


def write_tiny_gguf(
    path: Path, arch: str = "llama", tied: bool = True, seed: int = 0
) -> dict[str, np.ndarray]:
    """A 2-layer float32 GGUF; returns the Hugging Face-layout weights it encodes."""
    rng = np.random.default_rng(seed)
    hidden, heads, kv_heads, head_dim, ffn, layers = _TINY_DIMS
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_alphabet()]
    writer = gguf.GGUFWriter(str(path), arch)
    _add_tiny_metadata(writer, tokens)
    hf: dict[str, np.ndarray] = {}

    def add(
        gguf_name: str,
        hf_name: str,
        shape: tuple[int, ...],
        stored: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        hf[hf_name] = rng.standard_normal(shape).astype(np.float32)
        writer.add_tensor(gguf_name, hf[hf_name] if stored is None else stored(hf[hf_name]))

    add("token_embd.weight", "model.embed_tokens.weight", (len(tokens), hidden))
    add("output_norm.weight", "model.norm.weight", (hidden,))
    if not tied:
        add("output.weight", "lm_head.weight", (len(tokens), hidden))
    for i in range(layers):
        blk, hfl = f"blk.{i}", f"model.layers.{i}"
        permute = arch == "llama"
        add(
            f"{blk}.attn_q.weight",
            f"{hfl}.self_attn.q_proj.weight",
            (heads * head_dim, hidden),
            (lambda w: _llama_cpp_permute(w, heads)) if permute else None,
        )
        add(
            f"{blk}.attn_k.weight",
            f"{hfl}.self_attn.k_proj.weight",
            (kv_heads * head_dim, hidden),
            (lambda w: _llama_cpp_permute(w, kv_heads)) if permute else None,
        )
        add(f"{blk}.attn_v.weight", f"{hfl}.self_attn.v_proj.weight", (kv_heads * head_dim, hidden))
        add(f"{blk}.attn_output.weight", f"{hfl}.self_attn.o_proj.weight", (hidden, heads * head_dim))
        add(f"{blk}.attn_norm.weight", f"{hfl}.input_layernorm.weight", (hidden,))
        add(f"{blk}.ffn_norm.weight", f"{hfl}.post_attention_layernorm.weight", (hidden,))
        add(f"{blk}.ffn_gate.weight", f"{hfl}.mlp.gate_proj.weight", (ffn, hidden))
        add(f"{blk}.ffn_up.weight", f"{hfl}.mlp.up_proj.weight", (ffn, hidden))
        add(f"{blk}.ffn_down.weight", f"{hfl}.mlp.down_proj.weight", (hidden, ffn))
        if arch == "qwen2":
            for p, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                add(f"{blk}.attn_{p}.bias", f"{hfl}.self_attn.{p}_proj.bias", (n * head_dim,))
        if arch == "qwen3":
            add(f"{blk}.attn_q_norm.weight", f"{hfl}.self_attn.q_norm.weight", (head_dim,))
            add(f"{blk}.attn_k_norm.weight", f"{hfl}.self_attn.k_norm.weight", (head_dim,))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


# ----- the default model, against transformers ---------------------------------------------


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("kvrelay_cache")
    yield root
    shutil.rmtree(root, ignore_errors=True)  # ~540 MB of float32 weights; pytest keeps old tmp dirs


@pytest.fixture(scope="module")
def smollm(cache_root: Path) -> loader.LoadedModel:
    return load_model(None, cache_dir=str(cache_root))


@pytest.fixture(scope="module")
def transformers_gguf() -> tuple[dict, dict[str, torch.Tensor]]:
    """transformers' own reading of the default GGUF: (config dict, state dict).

    `from_pretrained(gguf_file=...)` needs `accelerate`; `load_gguf_checkpoint` with a model on
    the meta device runs the same name mapping, dequantization and q/k un-permutation without it.
    """
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    return config.to_dict(), parsed["tensors"]


def test_default_model_path_finds_the_smollm2_gguf() -> None:
    path = default_model_path()
    assert path.is_file() and path.suffix == ".gguf"
    assert path.name.startswith("SmolLM2-135M-Instruct")
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_default_model_identity(smollm: loader.LoadedModel) -> None:
    assert smollm.name == "SmolLM2-135M-Instruct"
    assert smollm.source == str(default_model_path())
    assert smollm.spec.tie_word_embeddings and "lm_head.weight" not in smollm.weights


def test_default_model_is_also_reachable_by_its_served_name(
    smollm: loader.LoadedModel, cache_root: Path
) -> None:
    by_name = load_model("SmolLM2-135M-Instruct", cache_dir=str(cache_root))
    assert by_name.source == smollm.source and by_name.spec == smollm.spec


def test_gguf_weights_equal_transformers(smollm: loader.LoadedModel, transformers_gguf) -> None:
    _, reference = transformers_gguf
    assert set(smollm.weights) == set(reference)
    for name, expected in reference.items():
        ours = smollm.weights[name]
        assert ours.shape == expected.shape, name
        assert ours.dtype == torch.float32
        assert torch.equal(ours, expected.float()), name


def test_gguf_spec_matches_transformers_config(smollm: loader.LoadedModel, transformers_gguf) -> None:
    config, _ = transformers_gguf
    expected = ModelSpec.from_hf_config(config)
    ours = smollm.spec
    for field in (
        "architecture",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "attention_bias",
        "qk_norm",
        "rope_scaling",
        "bos_token_id",
        "eos_token_ids",
    ):
        assert getattr(ours, field) == getattr(expected, field), field
    assert math.isclose(ours.rms_norm_eps, expected.rms_norm_eps, rel_tol=1e-6)
    assert ours.rope_theta == expected.rope_theta == 100000.0


def test_cache_entry_is_standard_safetensors(smollm: loader.LoadedModel, cache_root: Path) -> None:
    from safetensors.torch import load_file

    entry = loader.cache_entry_dir(default_model_path(), cache_root / "models")
    reread = load_file(str(entry / "model.safetensors"))
    name = "model.layers.3.self_attn.k_proj.weight"
    assert torch.equal(reread[name], smollm.weights[name])


def test_second_load_reads_the_cache_fast_without_parsing_gguf(
    smollm: loader.LoadedModel, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_gguf(*args, **kwargs):
        raise AssertionError("the GGUF was parsed although a cache entry exists")

    monkeypatch.setattr(gguf_loader, "GGUFReader", no_gguf)
    monkeypatch.setattr(gguf_loader, "open_gguf", no_gguf)
    start = time.perf_counter()
    again = load_model(None, cache_dir=str(cache_root))
    assert time.perf_counter() - start < 3.0
    assert again.spec == smollm.spec and again.name == smollm.name
    assert again.tokenizer.encode("Hello there") == smollm.tokenizer.encode("Hello there")
    for name, tensor in smollm.weights.items():
        assert torch.equal(again.weights[name], tensor), name


def test_load_casts_to_the_requested_dtype(smollm: loader.LoadedModel, cache_root: Path) -> None:
    half = load_model(None, dtype=torch.bfloat16, cache_dir=str(cache_root))
    assert all(w.dtype == torch.bfloat16 for w in half.weights.values())
    name = "model.norm.weight"
    assert torch.equal(half.weights[name], smollm.weights[name].to(torch.bfloat16))


# ----- tiny GGUF files: permutation, architectures, cache behaviour, errors -----------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_round_trips_weights_per_architecture(arch: str, tmp_path: Path) -> None:
    expected = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch=arch, tied=arch != "qwen3")
    loaded = load_model(str(tmp_path / f"tiny-{arch}.gguf"), cache_dir=str(tmp_path / "cache"))
    assert set(loaded.weights) == set(expected)
    for name, weights in expected.items():
        assert torch.equal(loaded.weights[name], torch.from_numpy(weights)), name
    spec = loaded.spec
    assert (spec.architecture, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (arch, 4, 2, 8)
    assert spec.tie_word_embeddings == (arch != "qwen3")
    assert spec.attention_bias == (arch == "qwen2") and spec.qk_norm == (arch == "qwen3")
    assert spec.rope_theta == 1e6 and spec.vocab_size == 259 and spec.max_position_embeddings == 256
    assert loaded.name == f"tiny-{arch}"


def test_cache_dir_defaults_to_kvrelay_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "env_cache"))
    load_model(str(tmp_path / "tiny.gguf"))
    entries = list((tmp_path / "env_cache" / "models").iterdir())
    assert len(entries) == 1 and (entries[0] / "model.safetensors").is_file()


@pytest.mark.parametrize("damage", ["truncate_weights", "garbage_model_json", "delete_tokenizer"])
def test_corrupt_cache_entry_is_rebuilt(damage: str, tmp_path: Path) -> None:
    expected = write_tiny_gguf(tmp_path / "tiny.gguf")
    cache = str(tmp_path / "cache")
    load_model(str(tmp_path / "tiny.gguf"), cache_dir=cache)
    entry = loader.cache_entry_dir(tmp_path / "tiny.gguf", tmp_path / "cache" / "models")
    weights_file = entry / "model.safetensors"
    if damage == "truncate_weights":
        with open(weights_file, "r+b") as f:
            f.truncate(weights_file.stat().st_size // 2)
    elif damage == "garbage_model_json":
        (entry / "model.json").write_bytes(b"\x00not json")
    else:
        (entry / "tokenizer.json").unlink()
    loaded = load_model(str(tmp_path / "tiny.gguf"), cache_dir=cache)
    assert torch.equal(loaded.weights["model.norm.weight"], torch.from_numpy(expected["model.norm.weight"]))
    assert (entry / "tokenizer.json").is_file()
    assert loader.mmap_safetensors(weights_file).keys() == expected.keys()


def test_edited_gguf_gets_a_new_cache_entry(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, seed=0)
    first = load_model(str(path), cache_dir=str(tmp_path / "cache"))
    expected = write_tiny_gguf(path, seed=1)
    second = load_model(str(path), cache_dir=str(tmp_path / "cache"))
    assert torch.equal(second.weights["model.norm.weight"], torch.from_numpy(expected["model.norm.weight"]))
    assert not torch.equal(first.weights["model.norm.weight"], second.weights["model.norm.weight"])


def test_missing_path_is_a_file_not_found_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model(str(tmp_path / "nope.gguf"), cache_dir=str(tmp_path))


def test_garbage_gguf_is_a_value_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match=r"x\.gguf.*not a readable GGUF"):
        load_model(str(tmp_path / "x.gguf"), cache_dir=str(tmp_path / "cache"))


def test_truncated_gguf_is_a_value_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    write_tiny_gguf(path)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1000)
    with pytest.raises(ValueError, match=r"cut\.gguf"):
        load_model(str(path), cache_dir=str(tmp_path / "cache"))


def test_unsupported_architecture_is_a_value_error(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"phi\.gguf.*unsupported architecture 'phi3'"):
        load_model(str(tmp_path / "phi.gguf"), cache_dir=str(tmp_path / "cache"))


def test_directory_without_config_json_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_model(str(tmp_path))


def test_llama3_rope_scaling_is_recovered_from_rope_freqs() -> None:
    # Llama 3.1's rope_scaling, turned into per-frequency divisors the way llama.cpp writes them.
    head_dim, theta, factor, low, high, original = 128, 500000.0, 8.0, 1.0, 4.0, 8192
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    divisors = []
    for wavelen in 2 * math.pi / inv_freq:
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1.0 / ((1 - smooth) / factor + smooth))
    scaling = gguf_loader.llama3_scaling_from_factors(np.array(divisors, dtype=np.float32), head_dim, theta)
    assert scaling is not None
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == factor
    assert scaling["original_max_position_embeddings"] == original
    assert scaling["low_freq_factor"] == low and scaling["high_freq_factor"] == pytest.approx(high, rel=1e-3)


# ----- Hugging Face directories ------------------------------------------------------------


@pytest.mark.parametrize("family,sharded", [("llama", False), ("qwen2", True)])
def test_hf_directory_loads_weights_spec_and_tokenizer(
    family: str, sharded: bool, smollm: loader.LoadedModel, tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    config_class = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
    config = config_class(
        vocab_size=smollm.tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path, max_shard_size="1MB" if sharded else "5GB")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    smollm.tokenizer.save(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded

    loaded = load_model(str(tmp_path), dtype=torch.float32)
    expected = model.state_dict()
    assert set(loaded.weights) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded.weights[name], tensor), name
    assert loaded.spec == replace(ModelSpec.from_hf_config(config.to_dict()), eos_token_ids=(2, 0))
    assert loaded.spec.attention_bias == (family == "qwen2")
    assert loaded.name == tmp_path.name and loaded.source == str(tmp_path.resolve())
    assert loaded.tokenizer.encode("Hi <|im_end|>") == smollm.tokenizer.encode("Hi <|im_end|>")
    assert loaded.tokenizer.stop_token_ids == {0, 2}


def test_hf_directory_without_weights_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 10,
                "hidden_size": 8,
                "intermediate_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            }
        )
    )
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(str(tmp_path))


def test_cached_model_fuses_projections_as_views_of_the_map_without_copies(
    smollm: loader.LoadedModel, cache_root: Path
) -> None:
    """The second load memory-maps the cache; q/k/v and gate/up lie back to back there, 64-byte
    aligned, so the fused parameters are views of the map and nothing is copied."""
    from kvrelay.model.llama import build_model

    cached = load_model(None, cache_dir=str(cache_root))
    model = build_model(cached.spec, cached.weights, torch.float32, torch.device("cpu"))
    layer = model.model.layers[0]
    qkv, q = layer.self_attn.qkv_proj.weight, cached.weights["model.layers.0.self_attn.q_proj.weight"]
    gate_up = layer.mlp.gate_up_proj.weight
    assert qkv.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
    assert qkv.data_ptr() == q.data_ptr()
    for param in model.parameters():
        assert param.data_ptr() % 64 == 0
    assert gate_up.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()

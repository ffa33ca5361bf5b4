"""DeepSeek-V2/V3 (dense layers, MLA) against transformers, and the engine on its latent cache."""

from __future__ import annotations

import pytest
import torch

from kvrelay.attention.forward_context import ForwardContext, set_forward_context
from kvrelay.attention.layer import build_attention_metadata
from kvrelay.engine.llm import LLM
from kvrelay.model.llama import build_model
from kvrelay.model.spec import ModelSpec
from kvrelay.sampling_params import SamplingParams
from tests.tiny import hf_greedy
from tests.tiny_mla import mla_config, mla_hf_model, tiny_mla_model

ARCHS = ["deepseek_v2", "deepseek_v3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_equal_transformers(arch: str) -> None:
    hf = mla_hf_model(arch)
    loaded = tiny_mla_model(arch)
    model = build_model(loaded.spec, loaded.weights, torch.float32, torch.device("cpu"))
    spec = loaded.spec
    for layer in model.attention_layers().values():
        layer.kv_cache = torch.zeros(8, 16, spec.kv_lora_rank + spec.qk_rope_head_dim)  # [N, bs, latent]
    ids = torch.randint(1, 256, (21,), generator=torch.Generator().manual_seed(1))
    meta = build_attention_metadata([21], [21], [[3, 5]], 16, torch.device("cpu"))
    with torch.no_grad(), set_forward_context(
            ForwardContext(attn_metadata={n: meta for n in model.attention_layers()})):
        got = model.compute_logits(model(ids, torch.arange(21)))  # [T, vocab]
        expected = hf(ids[None]).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_decodes_from_the_latent_cache_like_transformers(arch: str) -> None:
    """Chunked prefill and decode read the paged latent cache: greedy tokens and logprobs match
    transformers' full-context forward passes."""
    llm = LLM(loaded_model=tiny_mla_model(arch), block_size=4, num_blocks=64, max_num_batched_tokens=8)
    prompt = [3 + (7 * i) % 200 for i in range(13)]  # 13 tokens: two chunks of prefill
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    tokens, logprobs = hf_greedy(mla_hf_model(arch), prompt, 6)
    assert out.token_ids == tokens
    got = [entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs or [], strict=True)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(logprobs), atol=1e-4, rtol=0)
    cache = next(iter(llm.engine.runner.kv_caches.values()))
    assert cache.shape == (64, 4, 32 + 8)  # one latent per token: kv_lora_rank + qk_rope_head_dim
    assert llm.engine.blocks_in_use == 0


def test_latent_cache_bytes_and_formats() -> None:
    engine = LLM(loaded_model=tiny_mla_model(), block_size=4, num_blocks=16, kv_cache_dtype="bf16").engine
    assert engine.get_stats()["kv_bytes_per_token"] == 2 * (32 + 8) * 2  # layers x latent x 2 bytes
    spec = engine.kv_cache_spec()
    assert spec.latent and spec.block_shape == (4, 40) and spec.block_bytes == 4 * 40 * 2
    assert engine.kv.fingerprint["layout"] == "mla[bs,32+8]"
    with pytest.raises(ValueError, match="fp8_e4m3 is not available for deepseek_v3's latent KV cache"):
        LLM(loaded_model=tiny_mla_model(), block_size=4, num_blocks=16, kv_cache_dtype="fp8")


def test_mixture_of_experts_layers_are_refused_by_name() -> None:
    cfg = mla_config("deepseek_v3", first_k_dense_replace=1).to_dict()
    with pytest.raises(ValueError, match="mixture-of-experts layers are not supported"):
        ModelSpec.from_hf_config(cfg)

"""CausalLM on paged KV blocks must give transformers' logits, whatever the batch shape."""

from __future__ import annotations

import pytest
import torch

from kvrelay.kernels import native
from kvrelay.model.llama import build_model
from kvrelay.model.spec import ModelSpec
from tests.kernels.builds import require_kernel
from tests.model.tiny import FAMILIES, PagedDriver, build_from_hf, hf_logits, hf_tiny_model

pytest.importorskip("transformers")

ATOL = 1e-4


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (length,), generator=g).tolist()


@pytest.fixture(scope="module", params=list(FAMILIES))
def models(request):  # type: ignore[no-untyped-def]
    hf = hf_tiny_model(request.param)
    return hf, build_from_hf(hf)


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=ATOL)


def test_full_prefill_matches_hf(models) -> None:  # type: ignore[no-untyped-def]
    hf, model = models
    tokens = prompt(23, seed=1)
    driver = PagedDriver(model)
    driver.add("a", tokens)
    (logits,) = driver.step([("a", 23)])
    assert_close(logits, hf_logits(hf, tokens))


def test_decode_steps_match_hf(models) -> None:  # type: ignore[no-untyped-def]
    hf, model = models
    tokens = prompt(14, seed=2)
    driver = PagedDriver(model)
    driver.add("a", tokens[:9])
    driver.step([("a", 9)])
    for n in range(9, 14):  # feed the "generated" tokens one at a time
        driver.seqs["a"].token_ids.append(tokens[n])
        (logits,) = driver.step([("a", 1)])
        assert_close(logits, hf_logits(hf, tokens[: n + 1])[n:])


def test_chunked_prefill_matches_hf(models) -> None:  # type: ignore[no-untyped-def]
    hf, model = models
    tokens = prompt(30, seed=3)
    ref = hf_logits(hf, tokens)
    driver = PagedDriver(model)
    driver.add("a", tokens)
    start = 0
    for chunk in (5, 7, 1, 17):
        (logits,) = driver.step([("a", chunk)])
        assert_close(logits, ref[start : start + chunk])
        start += chunk


def test_prefix_reuse_computes_only_the_suffix(models) -> None:  # type: ignore[no-untyped-def]
    hf, model = models
    shared = prompt(12, seed=4)  # 3 full blocks of 4
    first, second = shared + prompt(5, seed=5), shared + prompt(9, seed=6)
    driver = PagedDriver(model)
    driver.add("a", first)
    driver.step([("a", len(first))])
    driver.add("b", second, shared_prefix_of="a", shared_blocks=3)
    (logits,) = driver.step([("b", 9)])
    assert driver.seqs["b"].block_ids[:3] == driver.seqs["a"].block_ids[:3]
    assert_close(logits, hf_logits(hf, second)[12:])


def test_mixed_batch_matches_hf(models) -> None:  # type: ignore[no-untyped-def]
    hf, model = models
    decoding, chunked, fresh, decoding2 = prompt(11, 7), prompt(19, 8), prompt(6, 9), prompt(7, 10)
    driver = PagedDriver(model)
    driver.add("dec", decoding)
    driver.add("chunk", chunked)
    driver.add("dec2", decoding2)
    driver.step([("dec", 10), ("chunk", 5), ("dec2", 6)])
    driver.add("fresh", fresh)
    # decodes first, last and in the middle; block tables interleave across sequences
    outs = driver.step([("dec", 1), ("chunk", 9), ("fresh", 6), ("dec2", 1)])
    assert_close(outs[0], hf_logits(hf, decoding)[10:])
    assert_close(outs[1], hf_logits(hf, chunked)[5:14])
    assert_close(outs[2], hf_logits(hf, fresh))
    assert_close(outs[3], hf_logits(hf, decoding2)[6:])
    # and then a pure decode batch over sequences of different lengths
    for seq_id, tokens in (("fresh", fresh), ("dec2", decoding2)):
        driver.seqs[seq_id].token_ids.append(tokens[0])  # a "generated" token
    outs = driver.step([("fresh", 1), ("dec2", 1), ("chunk", 1)])
    assert_close(outs[0], hf_logits(hf, fresh + fresh[:1])[-1:])
    assert_close(outs[1], hf_logits(hf, decoding2 + decoding2[:1])[-1:])
    assert_close(outs[2], hf_logits(hf, chunked)[14:15])  # a 1-token chunk rides with the decodes


def _tiny_weights(family: str = "llama") -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    hf = hf_tiny_model(family)
    spec = ModelSpec.from_hf_config(hf.config.to_dict())
    return spec, {name: t.detach().clone() for name, t in hf.state_dict().items()}


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda w: w.pop("model.layers.1.self_attn.k_proj.weight"), "model.layers.1.self_attn.k_proj.weight"),
        (lambda w: w.pop("lm_head.weight"), "lm_head.weight"),
        (lambda w: w.update({"model.layers.0.mlp.extra.weight": torch.zeros(1)}), "model.layers.0.mlp.extra"),
        (lambda w: w.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 64)}), "mlp.up_proj.weight"),
        (lambda w: w.update({"model.norm.weight": torch.zeros(65)}), "model.norm.weight"),
    ],
    ids=["missing", "missing-lm-head", "unexpected", "fused-shape", "shape"],
)
def test_load_weights_error_names_the_bad_tensor(edit, message) -> None:  # type: ignore[no-untyped-def]
    spec, weights = _tiny_weights()
    edit(weights)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        build_model(spec, weights, torch.float32, torch.device("cpu"))


def test_tied_lm_head_shares_embedding_storage() -> None:
    spec, weights = _tiny_weights("llama-tied")
    weights.pop("lm_head.weight")
    model = build_model(spec, weights, torch.float32, torch.device("cpu"))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_unfused_weights_are_used_in_place() -> None:
    spec, weights = _tiny_weights()
    model = build_model(spec, weights, torch.float32, torch.device("cpu"))
    o_proj = model.get_parameter("model.layers.0.self_attn.o_proj.weight")
    assert o_proj.data_ptr() == weights["model.layers.0.self_attn.o_proj.weight"].data_ptr()
    assert model.model.embed_tokens.weight.data_ptr() == weights["model.embed_tokens.weight"].data_ptr()
    assert not any(p.is_meta for p in model.parameters())


def test_torch_fallbacks_match_hf(models, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The same mixed batch with every native kernel off: the torch routes of linear, the norms,
    SiLU, rotary, the KV write and decode attention."""
    monkeypatch.setenv("KVRELAY_NATIVE_KERNELS", "0")
    test_mixed_batch_matches_hf(models)


@pytest.mark.parametrize("arch", ["haswell", "generic"])
def test_avx2_and_generic_kernels_match_hf(  # type: ignore[no-untyped-def]
        models, arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same mixed batch with every native kernel built for AVX2 (no AVX-512) or for the
    compiler's baseline, whatever this CPU: what an AVX2-only machine runs, end to end."""
    monkeypatch.setenv("KVRELAY_NATIVE_ARCH", arch)
    for kernel, getter in (("paged_decode", native.paged_decode_kernel), ("linear", native.linear_kernel),
                           ("elementwise", native.elementwise_kernels)):
        require_kernel(kernel, arch, getter)
    test_mixed_batch_matches_hf(models)

"""P/D over the NIXL pull connector in every KV cache format, and the compatibility refusal.

Each format's P/D run must reproduce a single instance of the same format token for token, with
D computing only the last prompt token. A P and a D whose formats differ must refuse each other at
the handshake, naming the field, and D recomputes (policy `recompute`). Zero blocks in use after.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from kvrelay.engine.llm import LLM
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.kv_transfer.transport import nixl_available
from tests.kv_transfer.p2p.fake_transport import InProcessTransport
from tests.kv_transfer.p2p.pd import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    PD,
    kv_threads,
    nixl_config,
    prompt,
    reference_tokens,
)
from tests.tiny import tiny_loaded_model
from tests.tiny_mla import tiny_mla_model

FORMATS = ["float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"]


def engine(kv_cache_dtype: str, kv_transfer_config: dict[str, Any] | None = None) -> LLMEngine:
    return LLM(loaded_model=tiny_loaded_model(), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
               max_num_batched_tokens=256, kv_cache_dtype=kv_cache_dtype,
               kv_transfer_config=kv_transfer_config).engine


@pytest.fixture
def pairs(transports: list[InProcessTransport]) -> Iterator[list[PD]]:
    built: list[PD] = []
    yield built
    try:
        for pair in built:
            pair.settle()
            assert pair.p.blocks_in_use == 0 and pair.d.blocks_in_use == 0
    finally:
        for pair in built:
            pair.close()
    assert not kv_threads(), f"threads left behind: {kv_threads()}"


def make_pair(pairs: list[PD], p_format: str, d_format: str, **p_extra: Any) -> PD:
    pair = PD(engine(p_format, nixl_config("kv_producer", **p_extra)),
              engine(d_format, nixl_config("kv_consumer")))
    pairs.append(pair)
    return pair


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_pd_in_each_format_gives_a_single_instance_tokens(pairs: list[PD], kv_cache_dtype: str) -> None:
    pd = make_pair(pairs, kv_cache_dtype, kv_cache_dtype)
    prompts = {"exact": prompt(2 * BLOCK_SIZE, 1), "partial": prompt(3 * BLOCK_SIZE + 2, 2)}
    got = pd.run(prompts, max_tokens=6)
    assert got == reference_tokens(engine(kv_cache_dtype), prompts, 6)
    assert pd.d.get_stats()["prompt_tokens_computed"] == len(prompts)  # the rest came from P
    # a block of 2 layers x K,V x 2 heads x 4 tokens x 16 dims, at the format's element size
    element = {"float32": 4, "bfloat16": 2, "float16": 2}.get(kv_cache_dtype, 1)
    assert pd.d.kv_cache_spec().block_bytes == 2 * 2 * BLOCK_SIZE * 16 * element


def test_fp32_prefill_with_bf16_decode_is_refused_and_recomputed(pairs: list[PD],
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    pd = make_pair(pairs, "float32", "bfloat16", lease_seconds=1.0)
    tokens = prompt(2 * BLOCK_SIZE + 1, salt=31)
    params = pd.prefill(tokens, "p-mixed")
    with caplog.at_level(logging.WARNING):
        out = pd.decode({"mixed": (tokens, params)}, max_tokens=4)["mixed"]
    assert out.outputs[0].token_ids == reference_tokens(engine("bfloat16"), {"m": tokens}, 4)["m"]
    assert "kv_cache_dtype differs: ours 'bfloat16', theirs 'float32'" in caplog.text
    stats = pd.d.get_stats()
    assert stats["prompt_tokens_external"] == 0 and stats["prompt_tokens_computed"] == len(tokens)


def test_fp8_formats_refuse_each_other_naming_the_dtype(pairs: list[PD],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    pd = make_pair(pairs, "fp8_e5m2", "fp8_e4m3", lease_seconds=1.0)
    tokens = prompt(BLOCK_SIZE + 2, salt=32)
    params = pd.prefill(tokens, "p-fp8")
    with caplog.at_level(logging.WARNING):
        pd.decode({"fp8": (tokens, params)}, max_tokens=2)
    assert "kv_cache_dtype differs: ours 'fp8_e4m3', theirs 'fp8_e5m2'" in caplog.text
    assert pd.d.get_stats()["prompt_tokens_external"] == 0


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16"])
def test_pd_moves_an_mla_latent_cache(pairs: list[PD], kv_cache_dtype: str) -> None:
    def mla_engine(config: dict[str, Any] | None) -> LLMEngine:
        return LLM(loaded_model=tiny_mla_model(), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                   max_num_batched_tokens=256, kv_cache_dtype=kv_cache_dtype,
                   kv_transfer_config=config).engine

    pd = PD(mla_engine(nixl_config("kv_producer")), mla_engine(nixl_config("kv_consumer")))
    pairs.append(pd)
    prompts = {"a": prompt(3 * BLOCK_SIZE + 1, 3), "b": prompt(2 * BLOCK_SIZE, 4)}
    assert pd.run(prompts, max_tokens=5) == reference_tokens(mla_engine(None), prompts, 5)
    assert pd.d.get_stats()["prompt_tokens_computed"] == len(prompts)
    element = 4 if kv_cache_dtype == "float32" else 2
    # one latent tensor per layer: bytes per block = block_size x (kv_lora_rank + rope) x element
    assert pd.d.kv_cache_spec().block_bytes == BLOCK_SIZE * (32 + 8) * element
    assert pd.d.get_stats()["kv_transfer_bytes"] > 0


@pytest.fixture
def real_transport_pairs() -> Iterator[list[PD]]:
    """Like `pairs`, with the transports the connector really builds (TCP, NIXL where installed)."""
    built: list[PD] = []
    yield built
    try:
        for pair in built:
            pair.settle()
            assert pair.p.blocks_in_use == 0 and pair.d.blocks_in_use == 0
    finally:
        for pair in built:
            pair.close()
    assert not kv_threads(), f"threads left behind: {kv_threads()}"


@pytest.mark.parametrize("backend", ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed"))])
def test_mla_latent_cache_over_a_real_transport(real_transport_pairs: list[PD], backend: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRELAY_KV_SECRET", "kv-formats-test-secret-0123456789")

    def mla_engine(config: dict[str, Any] | None) -> LLMEngine:
        return LLM(loaded_model=tiny_mla_model(), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                   max_num_batched_tokens=256, kv_cache_dtype="float16",
                   kv_transfer_config=config).engine

    pd = PD(mla_engine(nixl_config("kv_producer", backend=backend)),
            mla_engine(nixl_config("kv_consumer", backend=backend)))
    real_transport_pairs.append(pd)
    prompts = {"c": prompt(4 * BLOCK_SIZE + 3, 5)}
    assert pd.run(prompts, max_tokens=4) == reference_tokens(mla_engine(None), prompts, 4)
    assert pd.d.get_stats()["prompt_tokens_computed"] == 1

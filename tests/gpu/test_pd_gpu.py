"""A prefill and a decode engine on one GPU reproduce a single GPU instance's greedy tokens
(skipped without a CUDA device): through the in-process transport (the connector's own logic on
device KV) and through the default transport that `kvrelay up` uses (NIXL where installed, else
TCP). Both end with no block in use and no connector thread left."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvrelay.engine.llm import LLM
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.kv_transfer.p2p import settings
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

NO_GPU = "needs a CUDA device: torch sees none"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)]

PROMPTS = {"short": prompt(BLOCK_SIZE - 1), "exact": prompt(2 * BLOCK_SIZE, 1),
           "partial": prompt(5 * BLOCK_SIZE + 3, 2)}
MAX_TOKENS = 8


def cuda_engine(kv_transfer_config: dict[str, Any] | None) -> LLMEngine:
    return LLM(loaded_model=tiny_loaded_model(), device="cuda", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
               max_num_batched_tokens=256, kv_transfer_config=kv_transfer_config).engine


@pytest.fixture(scope="module")
def single() -> Iterator[LLMEngine]:
    engine = cuda_engine(None)
    yield engine
    engine.shutdown()


@pytest.fixture
def pair() -> Iterator[PD]:
    pd = PD(cuda_engine(nixl_config("kv_producer")), cuda_engine(nixl_config("kv_consumer")))
    try:
        yield pd
        pd.settle()
        assert pd.p.blocks_in_use == 0 and pd.d.blocks_in_use == 0
    finally:
        pd.close()
    assert not kv_threads(), f"threads left behind: {kv_threads()}"


def test_pd_through_the_in_process_transport_gives_the_single_instance_tokens(
        monkeypatch: pytest.MonkeyPatch, single: LLMEngine) -> None:
    monkeypatch.setattr(settings, "make_transport", lambda *args: InProcessTransport())
    pd = PD(cuda_engine(nixl_config("kv_producer")), cuda_engine(nixl_config("kv_consumer")))
    try:
        assert pd.run(PROMPTS, MAX_TOKENS) == reference_tokens(single, PROMPTS, MAX_TOKENS)
        assert pd.d.get_stats()["prompt_tokens_computed"] == len(PROMPTS)  # the rest came from P
        pd.settle()
        assert pd.p.blocks_in_use == 0 and pd.d.blocks_in_use == 0
    finally:
        pd.close()
    assert not kv_threads(), f"threads left behind: {kv_threads()}"


def test_pd_through_the_default_transport_gives_the_single_instance_tokens(pair: PD,
                                                                           single: LLMEngine) -> None:
    assert pair.run(PROMPTS, MAX_TOKENS) == reference_tokens(single, PROMPTS, MAX_TOKENS)
    assert pair.d.get_stats()["prompt_tokens_computed"] == len(PROMPTS)

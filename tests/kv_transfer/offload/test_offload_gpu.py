"""OffloadConnector over GPU KV: stores gathered on a side stream into pinned buffers, loads
copied back on it; the tokens of a reloaded prompt are those it computed. Needs a GPU."""

from __future__ import annotations

import pytest
import torch

from kvrelay import LLM
from tests.kv_transfer.offload.helpers import (
    BLOCK_SIZE,
    LIVE_LLMS,
    NUM_BLOCKS,
    connector_stats,
    fresh_prefix_cache,
    generate,
    offload_config,
    prompts_of,
)
from tests.tiny import tiny_loaded_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="needs a CUDA device: GPU KV to offload")]


@pytest.mark.parametrize("sync_load_max_tokens", [10_000, 0], ids=["sync", "async"])
def test_gpu_kv_goes_to_the_cpu_tier_and_comes_back(sync_load_max_tokens) -> None:
    llm = LLM(loaded_model=tiny_loaded_model("llama"), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
              device="cuda", kv_transfer_config=offload_config(cpu_bytes="8MiB",
                                                               sync_load_max_tokens=sync_load_max_tokens))
    LIVE_LLMS.append(llm)
    prompts = prompts_of([70, 37])
    first = generate(llm, prompts)
    fresh_prefix_cache(llm)
    assert generate(llm, prompts) == first
    counts = connector_stats(llm)
    assert counts["offload_chunks_stored"] > 0 and counts["offload_chunks_loaded"] > 0

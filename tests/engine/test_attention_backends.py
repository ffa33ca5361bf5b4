"""One engine, every attention route: the same greedy tokens, prefix hits and chunked prefills
included, and no block left in use. The Triton route runs under the interpreter here."""

from __future__ import annotations

import pytest

from kvrelay import LLM, SamplingParams
from tests.tiny import tiny_loaded_model

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
PROMPTS = [[5 + i, 17, 3 * i + 1, 9, 40] * (2 + i) for i in range(3)]


def run(backend: str, **options) -> tuple[list[list[int]], LLM]:  # type: ignore[no-untyped-def]
    llm = LLM(loaded_model=tiny_loaded_model("llama", head_dim=16), num_blocks=64, block_size=4,
              attention_backend=backend, **options)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]  # prefix hits
    assert again == first
    return first, llm


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_attention_route_gives_the_cpu_route_s_tokens(backend: str) -> None:
    reference, _ = run("cpu")
    tokens, llm = run(backend)
    assert tokens == reference
    assert llm.engine.runner.backend.name == backend
    assert llm.engine.get_stats()["prompt_tokens_cached"] > 0
    assert llm.engine.blocks_in_use == 0


def test_the_triton_route_runs_chunked_prefills_beside_decodes() -> None:
    reference, _ = run("cpu", max_num_batched_tokens=8, long_prefill_token_threshold=6)
    tokens, llm = run("triton", max_num_batched_tokens=8, long_prefill_token_threshold=6)
    assert tokens == reference
    assert llm.engine.blocks_in_use == 0

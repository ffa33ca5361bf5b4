"""The engine on a CUDA device (skipped without one): float32 greedy tokens equal transformers'
on the same weights, CUDA-graph tokens equal eager ones, and the KV cache sized from
gpu_memory_utilization, also for two instances sharing the GPU. Small models: seconds each. The
sized caches use blocks of 256 tokens: at 16 a 2-layer model's share of an 80 GB GPU is millions
of blocks, about a microsecond each to set up."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrelay import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_measure  # noqa: E402
import model_shapes  # noqa: E402

NO_GPU = "needs a CUDA device: torch sees none"
SIZED_BLOCK_SIZE = 256  # tokens per block where the cache is sized from a share of the GPU
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)]

ROOT = Path(__file__).resolve().parents[2]
# A small Llama: GQA (2 query heads per KV head), head_dim 32, weights wide enough (std 0.05) that
# greedy tokens vary from step to step instead of repeating one token.
CONFIG = model_shapes.shape_config(
    "smollm2-135m", hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=False)
# Shorter than a block, exactly two blocks, several blocks with a partial last one, long enough
# to split the decode kernel's context.
PROMPT_LENS = (5, 32, 75, 300)
MAX_TOKENS = 16


def prompts() -> list[list[int]]:
    return [gpu_measure.random_prompts(1, n, CONFIG["vocab_size"], seed=n)[0] for n in PROMPT_LENS]


def weights(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return model_shapes.random_weights(CONFIG, seed=3, dtype=dtype, device="cuda", std=0.05)


def greedy_tokens(tensors: dict[str, torch.Tensor], dtype: str, **llm_args: Any) -> list[list[int]]:
    llm = LLM(loaded_model=model_shapes.loaded_model(CONFIG, tensors, "gpu-test"), dtype=dtype, device="cuda",
              kv_cache_memory="256MiB", max_model_len=1024, max_num_seqs=8, **llm_args)
    try:
        tokens = gpu_measure.kvrelay_greedy_tokens(llm.engine, prompts(), MAX_TOKENS)
        assert llm.engine.blocks_in_use == 0
        return tokens
    finally:
        llm.shutdown()


@pytest.fixture(autouse=True)
def no_tf32_and_memory_given_back() -> Iterator[None]:
    """float32 is float32 on both sides (torch's default, stated here); after each test this
    process gives its cached GPU memory back, so instances started later find it free."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("attention_backend", ["auto", "torch"])
def test_float32_greedy_tokens_equal_transformers_on_the_same_weights(attention_backend: str) -> None:
    tensors = weights(torch.float32)
    hf = model_shapes.hf_model(CONFIG, tensors)
    expected = [gpu_measure.hf_greedy_tokens(hf, "cuda", p, MAX_TOKENS)[0] for p in prompts()]
    got = greedy_tokens(tensors, "float32", attention_backend=attention_backend)
    assert got == expected
    assert len({t for tokens in expected for t in tokens}) > len(PROMPT_LENS)  # the check has teeth


def test_cuda_graph_tokens_are_identical_to_eager_tokens_in_bf16() -> None:
    tensors = weights(torch.bfloat16)
    assert greedy_tokens(tensors, "bfloat16") == greedy_tokens(tensors, "bfloat16", enforce_eager=True)


def test_kv_cache_sized_from_gpu_memory_utilization_has_blocks_and_serves() -> None:
    llm = LLM(loaded_model=model_shapes.loaded_model(CONFIG, weights(torch.bfloat16), "gpu-test"),
              device="cuda", dtype="bfloat16", gpu_memory_utilization=0.2, max_model_len=1024,
              block_size=SIZED_BLOCK_SIZE)
    try:
        assert llm.engine.num_blocks > 0
        runner = llm.engine.runner  # the CUDA graphs took no more than the budget kept for them
        assert 0 < runner.graph_pool_bytes <= runner.graph_reserve, (runner.graph_pool_bytes,
                                                                       runner.graph_reserve)
        out = llm.generate({"prompt_token_ids": prompts()[0]},
                           SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        assert llm.engine.blocks_in_use == 0
    finally:
        llm.shutdown()


# One instance in a child process: builds its engine with utilization 0.45, prints its block
# count, generates, then holds the GPU memory until its stdin closes.
_INSTANCE = textwrap.dedent("""
    import sys
    sys.path[:0] = [{root!r}, {benchmarks!r}]
    import torch, model_shapes
    from kvrelay import LLM, SamplingParams
    config = {config!r}
    tensors = model_shapes.random_weights(config, seed=3, dtype=torch.bfloat16, device="cuda")
    llm = LLM(loaded_model=model_shapes.loaded_model(config, tensors, "shared"), device="cuda",
              dtype="bfloat16", gpu_memory_utilization=0.45, max_model_len=1024, block_size={block_size})
    out = llm.generate({{"prompt_token_ids": [5, 6, 7]}},
                       SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
    print("READY", llm.engine.num_blocks, len(out[0].outputs[0].token_ids), flush=True)
    sys.stdin.read()
    llm.shutdown()
""")


def test_two_instances_at_045_each_start_on_one_gpu() -> None:
    code = _INSTANCE.format(root=str(ROOT), benchmarks=str(ROOT / "benchmarks"), config=CONFIG,
                            block_size=SIZED_BLOCK_SIZE)
    children: list[subprocess.Popen[str]] = []
    try:
        for _ in range(2):  # the second starts while the first holds its share
            child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            children.append(child)
            assert child.stdout is not None
            line = child.stdout.readline()
            if not line.startswith("READY"):
                child.kill()
                log = child.communicate()[1][-3000:]
                pytest.fail(f"instance {len(children)} did not start: {line!r}\n{log}")
            _, num_blocks, generated = line.split()
            assert int(num_blocks) > 0 and int(generated) == 2
    finally:
        for child in children:
            if child.poll() is None:
                child.communicate(input="", timeout=60)
    assert [c.returncode for c in children] == [0, 0]

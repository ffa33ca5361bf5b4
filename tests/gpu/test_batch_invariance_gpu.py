"""The batch-invariant mode on a CUDA device (skipped without one): the Triton route with every
row through the prefill kernel (aligned query tiles, one split), decode steps replayed from CUDA
graphs, cuBLAS without split-K. What tests/engine/test_batch_invariance.py proves on the CPU and
the interpreter cannot: the GPU's own arithmetic (docs/batch_invariance.md)."""

from __future__ import annotations

import random

import pytest
import torch

from kvrelay import LLM
from tests.engine.test_batch_invariance import decoded_and_prefilled, needle_in_batches, tokens
from tests.gpu.test_engine_gpu import CONFIG, NO_GPU, weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)]


def invariant_llm(dtype: str, **kwargs) -> LLM:  # type: ignore[no-untyped-def]
    import model_shapes  # benchmarks/, on the path once tests.gpu.test_engine_gpu is imported

    tensors = weights(torch.float32 if dtype == "float32" else torch.bfloat16)
    loaded = model_shapes.loaded_model(CONFIG, tensors, "gpu-test")
    return LLM(loaded_model=loaded, dtype=dtype, device="cuda",
               kv_cache_memory="256MiB", max_model_len=1024, max_num_seqs=48, block_size=16,
               batch_invariant=True, **kwargs)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_on_a_gpu_a_needle_has_the_same_logprobs_alone_and_in_batches_of_8_to_48(dtype: str) -> None:
    results = needle_in_batches(invariant_llm(dtype))
    assert all(same_logprobs and same_tokens for _, same_logprobs, same_tokens in results), results


def test_on_a_gpu_decode_logprobs_equal_prefill_logprobs() -> None:
    llm = invariant_llm("bfloat16", enable_prefix_caching=False)
    at_decode, at_prefill = decoded_and_prefilled(llm, tokens(random.Random(1), 180))
    assert torch.equal(at_decode, at_prefill)

"""Every attention backend gives the torch route's output, through the layer, on the same steps.

The Triton route runs here under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET
when there is no GPU), which has no bfloat16 and rounds float32 to fp8 wrongly: float32 and
float16 caches here, bfloat16 and fp8 on a GPU. Where a GPU is visible the kernels are compiled,
and compiled Triton cannot read host memory: every Triton case then runs on the GPU (DEVICE).
NOTE: with an fp8 cache the two routes differ by design on a fresh prompt: the Triton route
attends over the K/V it just stored (fp8, as vLLM's paged prefill does), the torch route over the
step's own K/V."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvrelay.attention.backends import CpuBackend, TorchBackend, select_backend
from kvrelay.attention.backends.gpu import TritonBackend
from kvrelay.attention.forward_context import ForwardContext, set_forward_context
from kvrelay.attention.kv_format import kv_format
from kvrelay.attention.layer import Attention
from kvrelay.attention.metadata import StepBatch
from tests.kernels.triton.reference import DEVICE

BLOCK_SIZE = 4
NUM_BLOCKS = 40
GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the "
                                           "Triton interpreter has no bfloat16")]


def make_layer(backend, num_heads: int, num_kv_heads: int, head_dim: int, fmt: str = "float32",
               device: str = "cpu") -> Attention:
    layer = Attention("layer", num_heads, num_kv_heads, head_dim, scale=head_dim**-0.5)
    layer.kv_format = kv_format(fmt)
    layer.kv_cache = torch.zeros(NUM_BLOCKS, 2, num_kv_heads, BLOCK_SIZE, head_dim,
                                 dtype=layer.kv_format.torch_dtype, device=device)
    layer.backend = backend
    return layer


def run_step(layer: Attention, batch: StepBatch, q, k, v):
    meta = layer.backend.build_metadata(batch)
    with set_forward_context(ForwardContext({"layer": meta})):
        return layer(q, k, v)


def shuffled_tables(seq_lens: list[int], seed: int) -> list[list[int]]:
    blocks = np.random.default_rng(seed).permutation(NUM_BLOCKS).tolist()
    tables, first = [], 0
    for n in seq_lens:
        count = -(-n // BLOCK_SIZE)
        tables.append(blocks[first:first + count])
        first += count
    return tables


def two_steps(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, backends, fmt: str,
              device: str):
    """A prefill step of two fresh prompts, then a mixed step (one decode, one chunk over its
    cached prefix), then a decode-only step; every backend's layer gets the same inputs. Returns
    each backend's outputs."""
    gen = torch.Generator().manual_seed(0)
    tables = shuffled_tables([13, 30], seed=1)
    steps = [([9, 17], [9, 17]), ([1, 13], [10, 30]), ([1, 1], [11, 31])]  # (query lens, seq lens)
    layers = [make_layer(b, num_heads, num_kv_heads, head_dim, fmt, device) for b in backends]
    outputs = [[] for _ in backends]
    for query_lens, seq_lens in steps:
        tokens = sum(query_lens)
        qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(device, dtype)
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
        for layer, out in zip(layers, outputs, strict=True):
            batch = StepBatch.from_lists(query_lens, seq_lens, tables, BLOCK_SIZE, torch.device(device))
            out.append(run_step(layer, batch, q, k, v).float())
    return outputs


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 16), (2, 2, 32)])
@pytest.mark.parametrize(("dtype", "fmt", "tol"), [(torch.float32, "float32", 1e-4),
                                                   (torch.float16, "float16", 3e-3),
                                                   pytest.param(torch.bfloat16, "bfloat16", 2e-2, marks=GPU)])
def test_triton_and_cpu_routes_match_the_torch_route_over_prefill_mixed_and_decode_steps(
        num_heads, num_kv_heads, head_dim, dtype, fmt, tol) -> None:
    device = str(DEVICE)
    backends = {"torch": TorchBackend(), "triton": TritonBackend(num_kv_heads, 64)}
    if device == "cpu":
        backends["cpu"] = CpuBackend()
    outputs = dict(zip(backends, two_steps(num_heads, num_kv_heads, head_dim, dtype, list(backends.values()),
                                           fmt, device), strict=True))
    for name, got in outputs.items():
        for step, want in enumerate(outputs["torch"]):
            torch.testing.assert_close(got[step], want, rtol=tol, atol=tol, msg=f"{name} route, step {step}")


def test_the_triton_route_writes_the_cache_as_the_torch_route_does() -> None:
    layers = [make_layer(b, 4, 2, 16, device=str(DEVICE)) for b in (TorchBackend(), TritonBackend(2, 64))]
    batch = StepBatch.from_lists([5, 1], [5, 7], [[3, 8], [12, 2]], BLOCK_SIZE, DEVICE)
    qkv = torch.randn(6, 8 * 16).to(DEVICE)
    for layer in layers:
        step = StepBatch.from_lists([5, 1], [5, 7], [[3, 8], [12, 2]], BLOCK_SIZE, DEVICE)
        run_step(layer, step, *qkv.split([64, 32, 32], -1))
    assert batch.slot_mapping.tolist() == [12, 13, 14, 15, 32, 10]
    torch.testing.assert_close(layers[1].kv_cache, layers[0].kv_cache)


def test_auto_picks_the_cpu_route_on_the_cpu() -> None:
    assert isinstance(select_backend("auto", torch.device("cpu"), 2, 64, 512), CpuBackend)
    assert isinstance(select_backend("torch", torch.device("cpu"), 2, 64, 512), TorchBackend)
    assert isinstance(select_backend("triton", torch.device("cpu"), 2, 64, 512), TritonBackend)


@pytest.mark.parametrize(("name", "head_dim", "latent", "message"), [
    ("triton", 48, False, "head_dim 48 is not a power of two"),
    ("triton", 64, True, "MLA's latent cache has no Triton kernels"),
    ("cpu-fast", 64, False, "unknown attention backend 'cpu-fast'"),
])
def test_a_backend_that_cannot_serve_the_model_is_refused_naming_why(name, head_dim, latent, message) -> None:
    with pytest.raises(ValueError, match=message):
        select_backend(name, torch.device("cpu"), 2, head_dim, 512, latent=latent)


def test_the_cpu_route_is_refused_off_the_cpu() -> None:
    with pytest.raises(ValueError, match="runs the native CPU kernels; the model is on meta"):
        select_backend("cpu", torch.device("meta"), 2, 64, 512)

"""The attention routes of the batch-invariant mode: a token's output is the same bits however its
step is made up. One sequence's tokens (fixed q, k, v per position) go through steps of other
shapes: its whole prompt in one prefill; its prompt in two chunks beside another prompt's chunk
and a decode; its last token as a one-token step alone, and in decode batches of other sizes
(for Triton also padded as a CUDA-graph replay pads them). Each row must equal, bitwise, the
same row of the whole prefill, and that prefill must match the torch route.

The CPU route runs the native kernel (kvrelay/attention/backends/cpu_rows.py); the Triton route
runs compiled on a GPU where one is visible (DEVICE), else under Triton's interpreter
(tests/conftest.py), which proves the kernel choice, the split count and the tiling, not the
GPU's arithmetic (docs/gpu.md)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvrelay.attention.backends import AttentionBackend, TorchBackend, select_backend
from kvrelay.attention.backends.cpu_rows import RowsCpuBackend
from kvrelay.attention.backends.gpu import TritonBackend
from kvrelay.attention.forward_context import ForwardContext, set_forward_context
from kvrelay.attention.layer import Attention
from kvrelay.attention.metadata import StepBatch
from tests.attention.test_backends import BLOCK_SIZE, NUM_BLOCKS, make_layer, shuffled_tables
from tests.kernels.triton.reference import DEVICE

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
LENGTH = 23  # the sequence under test: 5 full blocks and a partial one
CPU = torch.device("cpu")
Step = tuple[list[int], list[int], list[list[int]]]  # query lens, seq lens, block tables


class Tokens:
    """Fixed q, k, v for each position of a few sequences: the same inputs whatever the step."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.qkv = {name: torch.randn(64, width, generator=gen) for name in ("main", "other", "third")}

    def rows(self, parts: list[tuple[str, int, int]],
             device: torch.device = CPU) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the positions [start, end) of each named sequence, stacked in order."""
        qkv = torch.cat([self.qkv[name][start:end] for name, start, end in parts]).to(device)
        q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        return q, k, v


def tables(*lengths: int) -> list[list[int]]:
    return shuffled_tables(list(lengths), seed=7)


def run(layer: Attention, tokens: Tokens, step: Step, parts: list[tuple[str, int, int]]) -> torch.Tensor:
    query_lens, seq_lens, block_tables = step
    device = layer.kv_cache.device
    batch = StepBatch.from_lists(query_lens, seq_lens, block_tables, BLOCK_SIZE, device)
    assert layer.backend is not None
    meta = layer.backend.build_metadata(batch)
    with set_forward_context(ForwardContext({"layer": meta})):
        return layer(*tokens.rows(parts, device)).cpu()


def scenarios(backend_of: Callable[[], AttentionBackend],
              device: torch.device = CPU) -> dict[str, torch.Tensor]:
    """The main sequence's output rows (of the positions each scenario computes) per scenario."""
    def layer_for(backend: AttentionBackend) -> Attention:
        return make_layer(backend, HEADS, KV_HEADS, HEAD_DIM, device=str(device))

    tokens, out = Tokens(0), {}
    main, other, third = tables(LENGTH, 32, 16)
    layer = layer_for(backend_of())  # the whole prompt in one step
    out["whole"] = run(layer, tokens, ([LENGTH], [LENGTH], [main]), [("main", 0, LENGTH)])

    layer = layer_for(backend_of())  # two chunks (10 + 13) beside another prompt and a decode
    run(layer, tokens, ([9, 11], [9, 11], [third, other]), [("third", 0, 9), ("other", 0, 11)])
    first = run(layer, tokens, ([1, 10, 19], [10, 10, 30], [third, main, other]),
                [("third", 9, 10), ("main", 0, 10), ("other", 11, 30)])[1:11]
    second = run(layer, tokens, ([13, 1], [LENGTH, 11], [main, third]),
                 [("main", 10, LENGTH), ("third", 10, 11)])[:13]
    out["chunked"] = torch.cat([first, second])

    for batch_size in (1, 3):  # the last token as a decode step, alone and beside others
        layer = layer_for(backend_of())
        run(layer, tokens, ([LENGTH - 1, 30, 12], [LENGTH - 1, 30, 12], [main, other, third]),
            [("main", 0, LENGTH - 1), ("other", 0, 30), ("third", 0, 12)])
        lens = [LENGTH, 31, 13][:batch_size]
        parts = [("main", LENGTH - 1, LENGTH), ("other", 30, 31), ("third", 12, 13)][:batch_size]
        step = ([1] * batch_size, lens, [main, other, third][:batch_size])
        out[f"decode x{batch_size}"] = run(layer, tokens, step, parts)[:1]
    return out


def assert_invariant(out: dict[str, torch.Tensor]) -> None:
    whole = out["whole"]
    assert torch.equal(out["chunked"], whole)
    for name, rows in out.items():
        if name.startswith("decode"):
            assert torch.equal(rows, whole[-1:]), name


def test_the_cpu_route_computes_a_row_alike_in_every_step() -> None:
    out = scenarios(RowsCpuBackend)
    assert_invariant(out)
    reference = scenarios(TorchBackend)["whole"]
    torch.testing.assert_close(out["whole"], reference, rtol=1e-5, atol=1e-5)


def test_the_triton_route_computes_a_row_alike_in_every_step() -> None:
    out = scenarios(lambda: TritonBackend(KV_HEADS, 64, batch_invariant=True), DEVICE)
    assert_invariant(out)
    torch.testing.assert_close(out["whole"], scenarios(TorchBackend)["whole"], rtol=1e-5, atol=1e-5)


def test_the_triton_route_gives_a_graph_padded_decode_step_the_same_rows() -> None:
    backend = TritonBackend(KV_HEADS, 64, batch_invariant=True)
    assert backend.num_splits(1) == backend.num_splits(64) == 1
    tokens, (main, other) = Tokens(1), tables(LENGTH, 30)
    prefill = ([LENGTH - 1, 30], [LENGTH - 1, 30], [main, other])
    decode = ([1, 1], [LENGTH, 31], [main, other])
    parts = [("main", LENGTH - 1, LENGTH), ("other", 30, 31)]

    def prefilled_layer() -> Attention:
        layer = make_layer(backend, HEADS, KV_HEADS, HEAD_DIM, device=str(DEVICE))
        run(layer, tokens, prefill, [("main", 0, LENGTH - 1), ("other", 0, 30)])
        return layer

    want = run(prefilled_layer(), tokens, decode, parts)
    for padded in (2, 8):  # the captured sizes a step of two runs at
        layer = prefilled_layer()
        inputs = backend.graph_inputs(8, 16, DEVICE)  # a replay's static buffers, padded to `padded` rows
        inputs.fill(StepBatch.from_lists(*decode, BLOCK_SIZE, DEVICE), padded)
        pad = padded - 2  # padding rows: they write no KV (slot -1) and read no block
        rows = [torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in tokens.rows(parts, DEVICE)]
        with set_forward_context(ForwardContext({"layer": inputs.metadata_for(padded)})):
            got = layer(*rows)[:2].cpu()
        assert torch.equal(got, want), padded


def test_the_mode_has_no_torch_route_and_no_mla() -> None:
    with pytest.raises(ValueError, match="batch_invariant needs the cpu or triton attention route"):
        select_backend("torch", CPU, 2, 64, 512, batch_invariant=True)
    with pytest.raises(ValueError, match="MLA's latent cache"):
        select_backend("auto", CPU, 1, 64, 512, latent=True, batch_invariant=True)
    assert isinstance(select_backend("auto", CPU, 2, 64, 512, batch_invariant=True), RowsCpuBackend)
    triton = select_backend("triton", CPU, 2, 64, 512, batch_invariant=True)
    assert isinstance(triton, TritonBackend) and triton.batch_invariant


def test_the_cpu_route_refuses_a_block_outside_the_cache_and_needs_the_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    layer = make_layer(RowsCpuBackend(), HEADS, KV_HEADS, HEAD_DIM)
    tokens = Tokens(2)
    with pytest.raises(ValueError, match="outside the KV cache"):
        run(layer, tokens, ([1], [5], [[1, NUM_BLOCKS + 3]]), [("main", 4, 5)])
    monkeypatch.setenv("KVRELAY_NATIVE_KERNELS", "0")
    with pytest.raises(ValueError, match="needs the native attention kernel"):
        RowsCpuBackend()

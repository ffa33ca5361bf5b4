"""The Triton route compiles a fixed set of kernel variants, whatever the steps, and sends each
row of a mixed step to the kernel made for it.

A step's index tensors are views into the one int32 buffer the runner uploads (worker/staging.py):
their offsets, and the block table's row stride (the step's table width), change from step to
step. Had Triton specialised on them, an eager step would compile a new variant in the middle of
serving (0.3-9 s each on the engine thread). Here the steps are packed exactly as staging packs
them and the kernels' launches recorded; under the interpreter on the CPU, compiled on a GPU.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from kvrelay.attention.backends import TorchBackend
from kvrelay.attention.backends.gpu import TritonBackend, leading_decodes
from kvrelay.attention.metadata import StepBatch
from kvrelay.kernels.triton.decode import _decode_kernel
from kvrelay.kernels.triton.prefill import _prefill_kernel
from kvrelay.kernels.triton.store_kv import _store_kv_kernel
from kvrelay.worker.staging import pack_inputs, packed_sizes, unpack_inputs
from tests.attention.test_backends import BLOCK_SIZE, make_layer, run_step, shuffled_tables
from tests.kernels.triton.launches import recorded, variant_key
from tests.kernels.triton.reference import DEVICE

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
# (query lens, seq lens): decode-only steps of 1 to 5 sequences whose tables are 1 to 8 blocks
# wide, prefills, and mixed steps with their decodes first (as the runner orders them).
STEPS = [([1], [3]), ([1, 1], [5, 9]), ([1, 1, 1], [17, 30, 2]), ([1] * 4, [4, 8, 12, 16]), ([7], [7]),
         ([5, 3], [5, 3]), ([1, 6], [11, 6]), ([1, 1, 9], [21, 3, 9]), ([1] * 5, [22, 31, 4, 9, 13])]


def uploaded_step(query_lens: list[int], seq_lens: list[int], seed: int) -> StepBatch:
    """The step as the runner uploads it on a GPU: its int64 and int32 inputs packed back to back
    into two buffers, each copied to the device whole, the batch's tensors views into them."""
    batch = StepBatch.from_lists(query_lens, seq_lens, shuffled_tables(seq_lens, seed), BLOCK_SIZE, DEVICE)
    num_longs, num_ints = packed_sizes(batch, sum(query_lens))
    input_ids = np.zeros(sum(query_lens), dtype=np.int64)
    longs, ints = pack_inputs(batch, input_ids, torch.empty(num_longs, dtype=torch.int64),
                              torch.empty(num_ints, dtype=torch.int32))
    unpack_inputs(batch, longs.to(DEVICE), ints.to(DEVICE))
    return batch


def test_steps_of_any_width_and_batch_launch_one_variant_per_kernel_and_split_count(monkeypatch) -> None:
    layer = make_layer(TritonBackend(KV_HEADS, 2048), HEADS, KV_HEADS, HEAD_DIM, device=str(DEVICE))
    gen = torch.Generator().manual_seed(0)
    with (recorded(monkeypatch, _decode_kernel) as decodes,
          recorded(monkeypatch, _prefill_kernel) as prefills,
          recorded(monkeypatch, _store_kv_kernel) as stores):
        for seed, (query_lens, seq_lens) in enumerate(STEPS):
            qkv = torch.randn(sum(query_lens), (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(DEVICE)
            run_step(layer, uploaded_step(query_lens, seq_lens, seed), *qkv.split(
                [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1))
    decode_variants = defaultdict(set)
    for launch in decodes:
        decode_variants[launch.args["NUM_SPLITS"]].add(variant_key(_decode_kernel, launch))
    assert len(decodes) == 7 and len(prefills) == 4 and len(stores) == len(STEPS)
    assert {splits: len(keys) for splits, keys in decode_variants.items()} == {8: 1}  # splits fixed by 2048
    assert len({variant_key(_prefill_kernel, launch) for launch in prefills}) == 1
    assert len({variant_key(_store_kv_kernel, launch) for launch in stores}) == 1


def test_a_mixed_step_s_decode_rows_go_to_the_decode_kernel_and_match_the_torch_route(monkeypatch) -> None:
    query_lens, seq_lens = [1, 1, 9, 4], [21, 3, 9, 14]
    layers = [make_layer(b, HEADS, KV_HEADS, HEAD_DIM, device=str(DEVICE))
              for b in (TorchBackend(), TritonBackend(KV_HEADS, 2048))]
    qkv = torch.randn(sum(query_lens), (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(DEVICE)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
    tables = shuffled_tables(seq_lens, 3)
    # The two contexts the decodes attend to (20 and 2 positions) must hold the same K/V in both caches.
    for layer in layers:
        layer.kv_cache.copy_(torch.randn(layer.kv_cache.shape, generator=torch.Generator().manual_seed(1)))
    with recorded(monkeypatch, _decode_kernel) as decodes, recorded(monkeypatch, _prefill_kernel) as prefills:
        outputs = [run_step(layer, StepBatch.from_lists(query_lens, seq_lens, tables, BLOCK_SIZE, DEVICE),
                            q, k, v) for layer in layers]
    assert [launch.grid[0] for launch in decodes] == [2]  # one program row per decode sequence
    assert [launch.grid[1] for launch in prefills] == [2]  # the two prefills, and only they
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-4)


def test_leading_decodes_counts_the_one_token_rows_before_the_first_longer_one() -> None:
    assert leading_decodes(np.array([1, 1, 5, 1], dtype=np.int32)) == 2
    assert leading_decodes(np.array([3, 1], dtype=np.int32)) == 0
    assert leading_decodes(np.array([1, 1], dtype=np.int32)) == 2


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 1, 0, 2]])
def test_the_runner_puts_decodes_first_keeping_each_kind_in_order(order: list[int]) -> None:
    from kvrelay.worker.model_runner import decodes_first

    scheduled = {"a": 5, "b": 1, "c": 1, "d": 7}
    req_ids = [list(scheduled)[i] for i in order]
    got = decodes_first(req_ids, scheduled, 1)
    assert got == [r for r in req_ids if scheduled[r] == 1] + [r for r in req_ids if scheduled[r] > 1]
    assert decodes_first(["b", "c"], scheduled, 1) == ["b", "c"]

"""The attention kernels launch with the tiles kernels/triton/tiling.py chose for the head size
and dtype, give the reference's answer with them (a query tile, a context tile smaller than a
block and than the context), and, compiled on a GPU, spill no register."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton, or the test extra)")

from kvrelay.kernels.triton.decode import _decode_kernel  # noqa: E402
from kvrelay.kernels.triton.prefill import _prefill_kernel  # noqa: E402
from kvrelay.kernels.triton.tiling import Tiles, decode_tiles, prefill_tiles  # noqa: E402
from tests.kernels.triton.launches import Launch, recorded  # noqa: E402
from tests.kernels.triton.reference import INTERPRETED, NO_BF16_REASON  # noqa: E402
from tests.kernels.triton.test_paged_decode import decode_case  # noqa: E402
from tests.kernels.triton.test_paged_prefill import prefill_case  # noqa: E402

BF16 = pytest.param(torch.bfloat16,
                    marks=[pytest.mark.gpu, pytest.mark.skipif(INTERPRETED, reason=NO_BF16_REASON)])


def test_the_tiles_shrink_with_the_head_size_and_for_float32() -> None:
    assert prefill_tiles(64, torch.bfloat16) == Tiles(64, 64, 4)
    assert prefill_tiles(128, torch.bfloat16) == Tiles(64, 64, 8)
    assert prefill_tiles(256, torch.float16) == Tiles(32, 32, 8)
    assert prefill_tiles(32, torch.float32) == Tiles(32, 32, 4)
    assert prefill_tiles(128, torch.float32) == Tiles(32, 32, 8)
    assert prefill_tiles(256, torch.float32) == Tiles(16, 16, 8)
    assert decode_tiles(64, torch.float32) == Tiles(1, 64, 4)
    assert decode_tiles(128, torch.bfloat16) == Tiles(1, 64, 8)
    assert decode_tiles(128, torch.float32) == Tiles(1, 32, 8)
    assert decode_tiles(256, torch.float32) == Tiles(1, 16, 8)


def check_launch(launch: Launch, tiles: Tiles, prefill: bool) -> None:
    assert (launch.args["BLOCK_N"], launch.args["num_warps"]) == (tiles.block_n, tiles.num_warps)
    if prefill:
        assert launch.args["BLOCK_M"] == tiles.block_m
    if launch.compiled is not None:  # compiled for the GPU: the allocation ptxas made
        assert launch.compiled.n_spills == 0, f"{launch.compiled.n_spills} registers spilled, {launch.args}"


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_prefill_and_decode_run_their_tiles_and_match_the_reference(monkeypatch, dtype, head_dim) -> None:
    with recorded(monkeypatch, _prefill_kernel) as prefills, recorded(monkeypatch, _decode_kernel) as decodes:
        prefill_case([(40, 40), (3, 50)], 4, 2, head_dim, dtype, dtype, seed=6)
        decode_case([70, 5], 4, 2, head_dim, dtype, dtype, num_splits=2, seed=7)
    check_launch(prefills[0], prefill_tiles(head_dim, dtype), prefill=True)
    check_launch(decodes[0], decode_tiles(head_dim, dtype), prefill=False)

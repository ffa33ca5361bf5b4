"""benchmarks/transfer_gpu.py (`bench_transfer.py --gpu`) run on host memory: every column moves
the blocks and is checked against P's, and the table carries issue 33's two ratios. The GPU run
executes this same code with the pools on the device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import transfer_gpu  # noqa: E402

from kvrelay.kv_transfer.transport import nixl_available  # noqa: E402


def test_the_dry_run_moves_every_column_and_prints_both_ratios(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    table = tmp_path / "gpu.md"
    assert transfer_gpu.run_gpu([40], [16], reps=1, device="cpu", markdown=table) == 0
    out = capsys.readouterr().out
    assert "could not be set up" not in out
    header, rule, row = table.read_text().splitlines()[2:5]
    names = [c.strip() for c in header.strip("|").split("|")]
    cells = dict(zip(names, (c.strip() for c in row.strip("|").split("|")), strict=True))
    assert cells["tokens"] == "40" and cells["block_size"] == "16"
    moved = ["block copy", "pinned", "cuda_ipc", "staging"] + (["nixl vram"] if nixl_available() else [])
    for column in moved + ["cuda_ipc / block copy", "staging / pinned"]:
        assert float(cells[column]) > 0, column
    assert "smollm2-135m: bf16, 30 layers x 3 KV heads x 64" in out


def test_the_issue_s_layout_is_the_512_mib_block_set() -> None:
    layers, heads, head_dim = transfer_gpu.LAYOUTS["llama-8b"]
    bytes_per_token = layers * 2 * heads * head_dim * 2  # K and V, bf16
    assert bytes_per_token * 4096 == 512 * 2**20

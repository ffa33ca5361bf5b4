"""benchmarks/decode_by_batch.py on a tiny model: a row per batch size, the engine left clean."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "decode_by_batch.py"


def test_prints_a_row_per_batch_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.tiny import write_tiny_model_dir

    spec = importlib.util.spec_from_file_location("decode_by_batch", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["decode_by_batch"] = module
    spec.loader.exec_module(module)
    model = write_tiny_model_dir(tmp_path / "model")
    assert module.main(["--model", str(model), "--rounds", "2", "--steps", "2", "--context", "16",
                        "--batches", "1,3"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "3"]
    assert rows[0][-1] == "1.00" and all(float(x) > 0 for r in rows for x in r[1:])

"""benchmarks/bench_routing.py's workload: Mooncake block ids become prompts sharing exactly
those blocks, whole prefix families are kept, arrivals keep the trace's gaps at the asked rate."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_routing.py"


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_routing", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_routing"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def write_trace(path: Path, rows: list[tuple[int, int, list[int]]]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 10,
                                        "hash_ids": ids}) + "\n" for t, n, ids in rows))
    return path


def test_prompts_share_exactly_the_blocks_their_ids_share(tmp_path: Path) -> None:
    bench = load_bench()
    trace = write_trace(tmp_path / "t.jsonl", [
        (0, 1536, [1, 2, 3]),        # family (1, 2)
        (1000, 1200, [7, 8, 9]),     # family (7, 8): too small, left out
        (2000, 1536, [1, 2, 4]),
        (4000, 2048, [1, 2, 4, 5]),
    ])
    requests = bench.build_requests(trace, families=1, min_members=3, per_family=3, tokens_per_id=32,
                                    rate=1.0)
    a, b, c = (list(r.token_ids) for r in requests)
    assert (len(a), len(b), len(c)) == (96, 96, 128)  # 1536 / 512 * 32 ...
    assert a[:64] == b[:64] and a[64:] != b[64:]      # ids 1, 2 shared; 3 vs 4 differ
    assert c[:96] == b and c[96:] != a[64:]           # ids 1, 2, 4 shared
    assert [r.arrival_s for r in requests] == pytest.approx([0.0, 1.0, 2.0])  # 2 gaps at 1 req/s


def test_too_few_families_is_an_error_naming_them(tmp_path: Path) -> None:
    bench = load_bench()
    trace = write_trace(tmp_path / "t.jsonl", [(0, 512, [1, 2]), (1, 512, [1, 2])])
    with pytest.raises(ValueError, match="only 0 families of 3"):
        bench.build_requests(trace, families=1, min_members=3, per_family=3, tokens_per_id=32, rate=1.0)

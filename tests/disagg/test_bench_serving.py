"""benchmarks/bench_serving.py runs end to end against a fake streaming endpoint."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.disagg.servers import FakeBackend, ServerThread

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serving.py"


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_serving", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_workload_is_a_fixed_seed_mix_of_long_and_short_prompts() -> None:
    bench = load_bench()
    first = bench.build_workload(8, 0.25, (8, 16), (100, 120), 16, seed=3)
    assert first == bench.build_workload(8, 0.25, (8, 16), (100, 120), 16, seed=3)
    assert sum(len(p.split()) > 100 for p in first.prompts) == 2
    assert first.gaps[0] == 0 and all(g > 0 for g in first.gaps[1:])


def test_percentiles_interpolate() -> None:
    bench = load_bench()
    assert bench.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert bench.percentile([0.0, 10.0], 90) == pytest.approx(9.0)


def test_bench_against_an_endpoint_prints_the_table_and_writes_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench()
    backend = FakeBackend("D", chunk_delay=0.01, num_chunks=4)
    out = tmp_path / "bench.json"
    with ServerThread(backend.app()) as server:
        assert bench.main(["--url", server.url, "--rates", "20,40", "--num-requests", "4",
                           "--json-out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "TTFT p99 (ms)" in printed and "goodput" in printed and "4/4" in printed
    results = json.loads(out.read_text())["results"][server.url]
    assert [r["rate"] for r in results] == [20.0, 40.0]
    assert all(r["num_ok"] == 4 and r["goodput"] == 1.0 for r in results)
    # Every request was streamed, with stream_options, and runs never share a prompt.
    bodies = [b for b in backend.requests if "warmup" not in b["messages"][0]["content"]]
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in bodies)
    assert len({b["messages"][0]["content"] for b in bodies}) == 8

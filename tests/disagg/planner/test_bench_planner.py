"""benchmarks/bench_planner.py: bench_serving's workload as planner requests, the verdict, and a
predictions-only run on given profiles (no servers, no model)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.disagg.planner.conftest import hand_profile

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_planner.py"


class WordTokenizer:
    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        return "<user> " + messages[0]["content"]

    def encode(self, text: str) -> list[int]:
        return [sum(map(ord, word)) for word in text.split()]


@pytest.fixture
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_planner", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_planner"] = module
    spec.loader.exec_module(module)
    module._TOKENIZERS[None] = WordTokenizer()
    return module


def test_workload_keeps_bench_servings_prompts_gaps_and_lengths(bench: ModuleType) -> None:
    wl = bench.bench_serving.build_workload(6, 0.5, (8, 16), (100, 120), 24, seed=0)
    planned = bench.planner_workload(wl, 2.0, 0, None)
    assert [r.output_len for r in planned.requests] == [24] * 6
    assert planned.requests[0].arrival_s == 0.0
    assert planned.requests[2].arrival_s == pytest.approx((wl.gaps[1] + wl.gaps[2]) / 2.0)
    # words of the prompt, plus the tag "[run 0]" (2) and the template's "<user>" (1)
    assert planned.requests[1].input_len == len(wl.prompts[1].split()) + 3
    # an id per full 16-token block; "<user> [run 0] Request " opens every prompt, then they differ
    first, second = planned.requests[0].hash_ids, planned.requests[1].hash_ids
    assert planned.hash_block_tokens == 16 and len(first) == planned.requests[0].input_len // 16
    assert first[0] != second[0] or first[1:] != second[1:]
    template = bench.block_ids([7] * 20, 16)
    assert template == bench.block_ids([7] * 16 + [8] * 4, 16) != bench.block_ids([8] * 16, 16)


def test_pd_better_by_share_in_slo_then_by_p90(bench: ModuleType) -> None:
    args = bench.parse_args(["--predict-only", "--threads", "2"])
    fast, slow = bench.Latencies([0.1] * 4, [0.01] * 4), bench.Latencies([2.0] * 4, [0.01] * 4)
    assert bench.pd_better({bench.PD: fast, bench.SINGLE: slow}, args, measured=False)
    assert not bench.pd_better({bench.PD: slow, bench.SINGLE: fast}, args, measured=False)
    near = bench.Latencies([0.2] * 4, [0.01] * 4)  # both all within the SLOs: the lower p90 wins
    assert bench.pd_better({bench.PD: fast, bench.SINGLE: near}, args, measured=False)


def test_predict_only_on_given_profiles(bench: ModuleType, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    paths = []
    for name in ("single", "pd"):
        path = tmp_path / f"{name}.json"
        hand_profile().save(path)
        paths.append(str(path))
    out = tmp_path / "out.json"
    assert bench.main(["--predict-only", "--threads", "2", "--profiles", ",".join(paths),
                       "--rates", "0.5,1", "--num-requests", "4", "--json-out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "rate 0.5 req/s" in text and "is P/D better here? predicted" in text
    report = json.loads(out.read_text())
    assert len(report["rows"]) == 2 * 2 * 4 and all(r["measured_ms"] is None for r in report["rows"])


def test_measure_target_calibrates_then_runs_every_rate(bench: ModuleType) -> None:
    from kvrelay.disagg.planner.sim import ClusterSpec
    from tests.disagg.servers import FakeBackend, ServerThread

    args = bench.parse_args(["--threads", "2", "--rates", "20,40", "--num-requests", "4",
                             "--calibration-requests", "2", "--model-name", "fake"])
    wl = bench.bench_serving.build_workload(4, 0.25, (8, 16), (30, 40), 4, seed=0)
    backend = FakeBackend("D", chunk_delay=0.01, num_chunks=8)
    with ServerThread(backend.app()) as server:
        samples, measured = bench.measure_target(server.url, "fake", args, wl)
    assert len(samples) == 2
    overheads = bench.overheads_from(samples, hand_profile(), ClusterSpec(num_colocated=1))
    assert set(overheads) == {"request", "step", "scale"} and all(v >= 0 for v in overheads.values())
    assert overheads["step"] > 0  # the fake streams a chunk every 10 ms; the profile decodes in 5
    assert sorted(measured) == [20.0, 40.0] and all(len(m.ttft_s) == 4 for m in measured.values())


def test_replay_predicts_against_a_stored_measurement_with_both_decode_models(
        bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = []
    for name in ("single", "pd"):
        prof = hand_profile()
        prof.decode_by_batch = {1: 5.0, 3: 3.0}
        prof.save(tmp_path / f"{name}.json")
        paths.append(str(tmp_path / f"{name}.json"))
    lat = bench.Latencies([0.5, 0.6, 0.7, 0.8], [0.01, 0.01, 0.02, 0.02], 1.0)
    spec = bench.RequestSpec(0.0, 20, 8)
    samples = {bench.SINGLE: [(spec, 0.05, 0.006)], bench.PD: [(spec, 0.08, 0.007)]}
    stored = tmp_path / "run.json"
    measured = {bench.SINGLE: {1.0: lat}, bench.PD: {1.0: lat}}
    stored.write_text(json.dumps(bench.measurement_json(samples, measured)))
    out = tmp_path / "again.json"
    assert bench.main(["--replay", str(stored), "--profiles", ",".join(paths), "--threads", "2",
                       "--rates", "1", "--num-requests", "4", "--json-out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "decode step by batch size, ms less the context term: 1: 5.0, 3: 3.0" in text
    assert text.count("within 25%: ") == 3  # per-batch table, linear fit, with the scale fitted
    report = json.loads(out.read_text())
    assert len(report["rows"]) == 8 and all(r["measured_ms"] is not None for r in report["rows"])
    assert len(report["linear_decode_fit"]["rows"]) == 8
    assert report["overhead_ms"]["P/D"]["step"] == pytest.approx(2.0)  # 7 ms measured, 5 predicted
    assert report["overhead_ms"]["P/D"]["scale"] == 1.0  # additive constants only, by default
    assert "with the step-time scale fitted" in text and len(report["fit_scale"]["rows"]) == 8
    assert report["fit_scale"]["overhead_ms"]["P/D"]["scale"] == 1.0  # one prompt length: no slope


def test_calibration_fits_how_much_slower_the_target_computes(bench: ModuleType) -> None:
    from kvrelay.disagg.planner.sim import ClusterSpec, simulate
    from kvrelay.disagg.planner.workload import Workload

    cluster, prof = ClusterSpec(num_colocated=1), hand_profile()  # prefill 10 + 1 ms/token; decode 5
    slow = bench.with_overhead(prof, {"request": 30.0, "step": 4.0, "scale": 2.0})
    samples = []
    for n in (20, 300, 40, 200):  # what a target twice as slow, with those overheads, measures
        spec = bench.RequestSpec(0.0, n, 8)
        result = simulate(cluster, slow, Workload((spec,)))
        samples.append((spec, result.ttft_s[0], result.tpot_s[0]))
    fitted = bench.overheads_from(samples, prof, cluster, scaled=True)
    assert fitted == pytest.approx({"request": 30.0, "step": 4.0, "scale": 2.0})
    additive = bench.overheads_from(samples, prof, cluster)  # the default: additive constants only
    assert additive["scale"] == 1.0 and additive["step"] == pytest.approx(9.0)  # 2 * 5 + 4 - 5

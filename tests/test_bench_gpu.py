"""benchmarks/bench_gpu.py's own logic on the CPU: tables, failures that become cells, the summary
against issue 32's targets, argument errors, the host section end to end (working tree against a
baseline revision, each in its child process), and the kvrelay / transformers measurements on a
tiny shape (the code the GPU run executes, on the CPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_gpu  # noqa: E402
import gpu_correctness  # noqa: E402
import gpu_measure  # noqa: E402
import host_steps  # noqa: E402
import model_shapes  # noqa: E402
from gpu_report import Failure, Section, markdown_table  # noqa: E402

TINY = model_shapes.shape_config("smollm2-135m", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)


def rate(tokens_per_s: float) -> gpu_measure.Rate:
    return gpu_measure.Rate(tokens_per_s, tokens=100, seconds=100 / tokens_per_s, step_ms=1.0)


def test_markdown_table_pads_every_column_to_its_widest_cell() -> None:
    text = markdown_table(["a", "long header"], [["wide cell", "1"], ["x", "22"]])
    lines = text.splitlines()
    assert lines[0] == "| a         | long header |"
    assert lines[1] == "|-----------|-------------|"
    assert lines[3] == "| x         | 22          |"
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        markdown_table(["a", "b", "c"], [["1", "2"]])


def test_busy_time_counts_overlapping_device_activity_once_and_ignores_host_events() -> None:
    events = [{"ph": "X", "cat": "kernel", "ts": 0, "dur": 10},
              {"ph": "X", "cat": "kernel", "ts": 5, "dur": 10},       # overlaps the first: +5
              {"ph": "X", "cat": "gpu_memcpy", "ts": 20, "dur": 2},
              {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 100},      # host work: not the GPU's
              {"ph": "i", "cat": "kernel", "ts": 30}]                  # not a duration event
    intervals = gpu_measure.gpu_intervals(events)
    assert gpu_measure.union_seconds(intervals) == pytest.approx(17e-6)
    assert gpu_measure.union_seconds([(0, 10), (2, 3), (20, 30)]) == pytest.approx(20e-6)


def test_first_difference_names_the_first_differing_token() -> None:
    assert gpu_measure.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert gpu_measure.first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert gpu_measure.first_difference([1, 2], [1, 2, 3]) == 2


def test_a_failing_measurement_becomes_a_failed_cell_and_the_next_one_still_runs(capsys) -> None:
    section = Section("throughput")

    def broken() -> None:
        raise RuntimeError("no kernel image for this device")

    failed = section.attempt("kvrelay single-stream decode", broken)
    assert isinstance(failed, Failure)
    assert section.attempt("transformers single-stream decode", lambda: rate(50.0)) == rate(50.0)
    assert "Traceback" in capsys.readouterr().out  # printed at once, not hidden
    assert section.failures[0]["error"] == "RuntimeError: no kernel image for this device"

    result = bench_gpu.ShapeResult("smollm2-135m", {"kv_single": failed, "hf_single": rate(50.0)})
    table = bench_gpu.throughput_table([result], bench_gpu.Plan())
    row = table.rows[0]
    assert row[2].startswith("FAILED: RuntimeError") and row[3] == "50 tok/s" and row[-1] == "-"
    assert table.rows[1][2] == "not run"


def test_summary_marks_each_target_met_or_missed() -> None:
    plan = bench_gpu.Plan()
    results = [bench_gpu.ShapeResult("smollm2-135m", {
                   "kv_single": rate(600), "kv_batch": rate(19_000),
                   "busy_1": gpu_measure.Busy(0.9, 1.0, 0.9, 300),
                   "busy_64": gpu_measure.Busy(0.5, 2.0, 1.0, 300)}),
               bench_gpu.ShapeResult("llama-3.2-1b", {
                   "kv_single": rate(400), "kv_batch": rate(15_000), "kv_prefill": rate(120_000),
                   "hf_prefill": rate(100_000)})]
    correctness = Section("correctness")
    correctness.results["correctness"] = {
        "triton": gpu_correctness.Agreement(["equal"] * 8, 8),
        "graphs": gpu_correctness.Agreement(["FAILED: x"] * 8, 0, failed=True)}
    sections = {"throughput": Section("throughput"), "busy": Section("busy"), "correctness": correctness}
    table = bench_gpu.summary_table(results, sections, plan)
    verdicts = {row[0]: (row[1], row[2]) for row in table.rows}
    assert verdicts["SmolLM2-135M single-stream decode >= 500 tok/s"] == ("600 tok/s", "yes")
    assert verdicts["SmolLM2-135M batch-64 decode >= 20,000 tok/s"] == ("19,000 tok/s", "NO")
    assert verdicts["Llama-3.2-1B prefill 2048 >= 1.0x transformers"] == ("1.20x", "yes")
    assert verdicts["SmolLM2-135M GPU busy at batch 64 >= 85%"] == ("50.0%", "NO")
    assert verdicts["Llama-3.2-1B GPU busy at batch 1 >= 85%"] == ("not run", "-")
    assert verdicts["fp32 greedy tokens = transformers' on every prompt"] == ("8/8", "yes")
    assert verdicts["CUDA-graph tokens identical to eager"] == ("FAILED", "-")
    line = bench_gpu.verdict_line([table], [])
    assert "targets met 6 of 8 measured" in line and "SmolLM2-135M batch-64 decode" in line


@pytest.mark.parametrize("argv, message", [
    (["--host-only", "--only", "host"], "exclude each other"),
    (["--host-steps", "0"], "--host-steps must be >= 1"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--device", "tpu"], "auto, cpu, cuda or cuda:N"),
    (["--device", "cpu", "--only", "throughput"], "need a CUDA device"),
    (["--only", "nothing"], "invalid choice"),
])
def test_argument_errors_name_the_cause(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_gpu.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_asking_for_cuda_without_a_gpu_is_refused_with_the_fix(capsys) -> None:
    with pytest.raises(SystemExit):
        bench_gpu.parse_args(["--device", "cuda"])
    err = capsys.readouterr().err
    assert "sees none" in err and "--host-only" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default sections of a machine without a GPU")
def test_without_a_gpu_the_default_run_is_the_host_section_on_the_cpu() -> None:
    args = bench_gpu.parse_args([])
    assert args.device == "cpu" and args.sections == ["host"] and args.host_devices == ["cpu"]


def test_a_baseline_that_is_not_a_commit_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no-such-revision"):
        host_steps.export_tree("no-such-revision", tmp_path)


def test_host_only_times_the_working_tree_and_a_baseline_in_one_run(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    code = bench_gpu.main(["--host-only", "--quick", "--baseline-rev", "HEAD", "--host-steps", "3",
                           "--json", str(out), "--markdown", str(tmp_path / "host.md")])
    assert code == 0
    results = json.loads(out.read_text())
    table = results["sections"]["host"]["tables"][0]
    assert table["headers"][2].startswith("baseline ")
    assert [row[:2] for row in table["rows"]] == [["cpu", "1"], ["cpu", "64"]]
    for row in table["rows"]:
        assert " / " in row[2] and " / " in row[3] and row[4].endswith("x"), row
    assert "Host time per decode step" in (tmp_path / "host.md").read_text()


@pytest.fixture
def tiny_shape(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(model_shapes.SHAPES, "tiny", TINY)
    monkeypatch.setitem(model_shapes.DISPLAY_NAMES, "tiny", "Tiny")
    monkeypatch.setitem(bench_gpu.TARGETS, "tiny", bench_gpu.Targets(1, 1, 0.0001))
    return "tiny"


def test_the_throughput_measurements_run_on_the_cpu_for_a_tiny_shape(tiny_shape: str) -> None:
    """Every kvrelay and transformers measurement of the GPU run, on the CPU (no CUDA graphs
    there: the engine runs eagerly), so a bug in them does not wait for a lent GPU."""
    plan = bench_gpu.Plan(shapes=(tiny_shape,), dtype="float32", single_tokens=3, batch=4, batch_steps=2,
                          decode_warmup=1, prefill_tokens=64, prefill_reps=1, hf_single_tokens=2,
                          hf_batch_steps=2)
    args = SimpleNamespace(device="cpu", seed=0, kv_cache_memory="16MiB")
    section = Section("throughput")
    result = bench_gpu.run_shape(tiny_shape, args, plan, section, None)  # type: ignore[arg-type]
    assert not section.failures, section.failures
    for key in ("kv_single", "kv_batch", "kv_prefill", "hf_single", "hf_batch", "hf_prefill"):
        assert isinstance(result.cells[key], gpu_measure.Rate) and result.cells[key].tokens_per_s > 0, key
    assert result.cells["kv_batch"].tokens == 4 * 2  # pure decode: one token per request per step
    assert all(row[-1] == "yes" for row in bench_gpu.throughput_table([result], plan).rows)


def test_the_correctness_section_runs_on_the_cpu_for_a_tiny_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_correctness, "CONFIG", TINY)
    section = Section("correctness")
    gpu_correctness.correctness_section("cpu", 0, num_prompts=2, n=3, section=section)
    assert not section.failures, section.failures
    agreements = section.results["correctness"]
    assert [agreements[k].cells for k in ("triton", "torch", "graphs")] == [["equal"] * 2] * 3
    assert section.tables[0].rows[-1] == ["all", "-", "2/2", "2/2", "2/2"]

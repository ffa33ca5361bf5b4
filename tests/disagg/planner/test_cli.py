"""`kvrelay profile` and `kvrelay plan` end to end, and their errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.entrypoints.cli import main
from tests.disagg.planner.conftest import hand_profile
from tests.disagg.planner.test_distserve import DATA

DISTSERVE = str(DATA / "profiler-a100-80g.distserve.json")


@pytest.fixture
def hand_profile_path(tmp_path: Path) -> str:
    path = tmp_path / "hand.json"
    hand_profile().save(path)
    return str(path)


def write_trace(path: Path, rows: list[dict[str, object]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_plan_prints_goodput_split_and_instances_needed(hand_profile_path: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"timestamp": 1000 * i, "input_length": 200, "output_length": 8, "hash_ids": [i % 3]}
            for i in range(30)]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    out_json = tmp_path / "plan.json"
    rc = main(["plan", "--profile", hand_profile_path, "--trace", trace, "--configs", "1,2,1P1D",
               "--ttft-slo", "0.5", "--tpot-slo", "0.05", "--json-out", str(out_json)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "recommended P:D split: 1:1" in text and "needs 1x colocated" in text
    assert "at 1 req/s (the trace's own rate: 30 requests over 29 s; --rate sets another):" in text
    report = json.loads(out_json.read_text())
    assert [r["cluster"] for r in report["results"]] == ["1x colocated", "2x colocated", "1P1D"]
    assert all(r["goodput"] > 0 for r in report["results"])


def test_the_synthetic_workload_says_its_defaults_and_where_the_rate_came_from(
        hand_profile_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for default in ("synthetic: N requests, default 200", "exp:MEAN (default 512)", "exp:MEAN (default 128)",
                    "a synthetic workload's is 1 req/s"):
        assert default in help_text, default
    args = ["plan", "--profile", hand_profile_path, "--configs", "1", "--needed-only", "--num-requests", "20",
            "--ttft-slo", "5", "--tpot-slo", "1"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "workload poisson(in=512,out=128): 20 requests" in text
    assert "at 1 req/s (the synthetic workload's default rate, 1 req/s; --rate sets another):" in text
    assert main([*args, "--rate", "0.5"]) == 0
    assert "at 0.5 req/s (--rate):" in capsys.readouterr().out


@pytest.mark.parametrize("make_args, message", [
    (lambda d: ["--profile", DISTSERVE, "--model", "facebook/opt-7b"], "'facebook/opt-7b' is not in profile"),
    (lambda d: ["--profile", d["hand"], "--model", "opt"], "'opt' is not in profile"),
    (lambda d: ["--profile", d["hand"], "--trace", d["empty"]], "is empty"),
    (lambda d: ["--profile", d["hand"], "--trace", d["bad"]], "input_length must be an integer"),
    (lambda d: ["--profile", d["hand"], "--trace", "/no/such.jsonl"], "/no/such.jsonl does not exist"),
    (lambda d: ["--profile", d["notjson"]], "not valid JSON"),
    (lambda d: ["--profile", d["hand"], "--configs", "1P"], "cluster shape '1P'"),
    (lambda d: ["--profile", d["hand"], "--input-len", "lots"], "not a length distribution"),
    (lambda d: ["--profile", d["hand"], "--ttft-slo", "0.001", "--num-requests", "20", "--configs", "1,1P1D"],
     "no configuration (1x colocated, 1P1D) meets p90 TTFT <= 0.001 s"),
    (lambda d: ["--profile", DISTSERVE, "--model", "facebook/opt-13b", "--configs", "1P1D"],
     "give the link with --link-bandwidth"),
    (lambda d: ["--profile", DISTSERVE, "--latency-model", "distserve", "--model", "facebook/opt-13b",
                "--distserve-tp", "3"], "no entry for TP [3]"),
])
def test_bad_input_is_a_clear_error(make_args, message: str,  # type: ignore[no-untyped-def]
                                    hand_profile_path: str, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    files = {"hand": hand_profile_path, "empty": write_trace(tmp_path / "empty.jsonl", []),
             "bad": write_trace(tmp_path / "bad.jsonl",
                                [{"timestamp": 0, "input_length": 0, "output_length": 1}]),
             "notjson": str(tmp_path / "x.json")}
    (tmp_path / "x.json").write_text("{not json")
    rc = main(["plan", *make_args(files)])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err


def test_error_exit_has_no_traceback(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "kvrelay.entrypoints.cli", "plan", "--profile", DISTSERVE,
                           "--model", "nope"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "'nope' is not in profile" in done.stderr
    assert "Traceback" not in done.stderr


def test_distserve_mode_runs_the_search(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--profile", DISTSERVE, "--latency-model", "distserve", "--model", "facebook/opt-13b",
               "--distserve-tp", "1", "--num-requests", "50", "--input-len", "100-400",
               "--output-len", "50-200",
               "--ttft-slo", "0.2", "--tpot-slo", "0.1", "--max-rate", "4"])
    text = capsys.readouterr().out
    assert rc == 0 and "best: tp_prefill=1, tp_decode=1" in text


def test_profile_command_writes_a_profile_plan_reads(tmp_path: Path) -> None:
    from tests.tiny import write_tiny_model_dir

    model = write_tiny_model_dir(tmp_path / "model")
    out = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, "-m", "kvrelay.entrypoints.cli", "profile", str(model), "--quick",
                           "--threads", "1", "--kv-cache-memory", "4MiB", "--max-num-batched-tokens", "128",
                           "--backends", "tcp", "-o", str(out), "--no-progress", "--co-run", "on"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    written = json.loads(out.read_text())
    assert written["threads"] == 1
    # beside a neighbour engine (the same tiny model, in a child process): a factor per kind
    assert set(written["co_run_slowdown"]) == {"prefill", "decode"}
    assert all(v >= 1.0 for v in written["co_run_slowdown"].values())
    assert {s["neighbour"] for s in written["samples"]["co_run"]} == {"prefill", "decode"}
    assert all(s["alone_ms"] > 0 and s["co_run_ms"] > 0 for s in written["samples"]["co_run"])
    assert "beside a busy neighbour instance" in done.stdout
    assert main(["plan", "--profile", str(out), "--num-requests", "20", "--input-len", "8-32",
                 "--output-len", "4", "--configs", "1,1P1D", "--ttft-slo", "10", "--tpot-slo", "1"]) == 0


def test_profile_command_refuses_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--backends", "rdma", "--quick"]) == 2
    assert "unknown transfer backend 'rdma'" in capsys.readouterr().err


def test_plan_plot_svg_has_a_curve_per_shape(hand_profile_path: str, tmp_path: Path) -> None:
    from kvrelay.disagg.planner.plan import CURVE_POINTS
    from tests.disagg.planner.test_svgplot import polyline_points

    rows = [{"timestamp": 1000 * i, "input_length": 200, "output_length": 8} for i in range(30)]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    out = tmp_path / "plots" / "plan.svg"
    rc = main(["plan", "--profile", hand_profile_path, "--trace", trace, "--configs", "1,1P1D",
               "--ttft-slo", "0.5", "--tpot-slo", "0.05", "--plot", str(out)])
    assert rc == 0
    lines = polyline_points(out.read_text())
    assert list(lines) == ["1x colocated", "1P1D"]
    assert all(len(points) >= CURVE_POINTS for points in lines.values())


@pytest.mark.parametrize("extra, message", [
    (["--plot", "plan.txt"], "must end in .svg, .png, .pdf"),
    (["--plot", "plan.png"], "needs matplotlib, which is not installed"),
    (["--plot", "plan.svg", "--needed-only", "--rate", "1"], "drop --needed-only"),
    (["--plot", "plan.svg", "--latency-model", "distserve"], "DistServe mode has no plot"),
])
def test_plot_errors_come_before_the_search(extra: list[str], message: str, hand_profile_path: str,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    rc = main(["plan", "--profile", hand_profile_path, "--num-requests", "5", *extra])
    captured = capsys.readouterr()
    assert rc == 2 and message in captured.err, captured.err
    assert "plan: 1x colocated" not in captured.err  # refused before any shape was searched

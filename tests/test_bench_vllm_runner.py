"""benchmarks/vllm_runner.py without vLLM: the Hugging Face directory it writes for vLLM holds what
kvrelay loads from the GGUF, and the child protocol (JSON in, one JSON line out) and its errors."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvrelay.model.loader import load_model
from tests.model.test_loader import write_tiny_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import vllm_runner  # noqa: E402


def test_hf_directory_loads_back_as_the_same_spec_and_weights_as_the_gguf(tmp_path: Path) -> None:
    gguf_path, cache = tmp_path / "tiny.gguf", tmp_path / "cache"
    write_tiny_gguf(gguf_path)
    directory = vllm_runner.hf_directory(gguf_path, cache)
    from_gguf = load_model(str(gguf_path), cache_dir=str(cache))
    from_dir = load_model(str(directory))
    assert from_dir.spec == from_gguf.spec
    assert from_dir.weights.keys() == from_gguf.weights.keys()
    for name, tensor in from_gguf.weights.items():
        assert torch.equal(from_dir.weights[name], tensor), name
    assert from_dir.tokenizer.encode("hello") == from_gguf.tokenizer.encode("hello")


def test_hf_directory_links_the_cached_weights_and_is_made_once(tmp_path: Path) -> None:
    gguf_path, cache = tmp_path / "tiny.gguf", tmp_path / "cache"
    write_tiny_gguf(gguf_path)
    directory = vllm_runner.hf_directory(gguf_path, cache)
    config_mtime = (directory / "config.json").stat().st_mtime_ns
    assert vllm_runner.hf_directory(gguf_path, cache) == directory
    assert (directory / "config.json").stat().st_mtime_ns == config_mtime
    assert (directory / "model.safetensors").stat().st_nlink >= 2  # the cache entry's file, not a copy
    assert not [p for p in directory.parent.iterdir() if p.name.startswith(".tmp-")]


def test_hf_config_refuses_a_model_it_cannot_describe(tmp_path: Path) -> None:
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    spec = load_model(str(gguf_path), cache_dir=str(tmp_path / "cache")).spec
    config = vllm_runner.hf_config(spec)
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == spec.rope_theta
    with pytest.raises(ValueError, match="qwen2"):
        vllm_runner.hf_config(replace(spec, architecture="qwen2"))


def test_a_missing_vllm_python_is_an_error_naming_it_and_the_fix(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "python"
    with pytest.raises(FileNotFoundError, match="make bench-vllm"):
        vllm_runner.vllm_python(str(missing))


def test_no_vllm_venv_means_no_vllm_column(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(vllm_runner, "DEFAULT_VLLM_PYTHON", tmp_path / ".venv-vllm" / "bin" / "python")
    assert vllm_runner.vllm_python(None) is None


def fake_interpreter(path: Path, script: str) -> Path:
    """An executable standing in for a vLLM venv's python: it ignores its arguments."""
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return path


def test_run_vllm_hands_over_the_workload_and_reads_the_last_json_line(tmp_path: Path) -> None:
    result = {"version": "0.0.test", "single_s": 0.5, "single_token_ids": [7, 8], "mixed_s": 2.0,
              "mixed_output_tokens": [3]}
    seen = tmp_path / "workload.json"
    python = fake_interpreter(tmp_path / "python", f"cat > {seen}\necho 'INFO log line'\n"
                              f"echo '{json.dumps(result)}'\n")
    times = vllm_runner.run_vllm(python, tmp_path, single_prompt=[1, 2], single_tokens=2,
                                 mixed=[([4, 5, 6], 3)], threads=2)
    assert times == vllm_runner.VllmTimes("0.0.test", 0.5, [7, 8], 2.0, [3])
    workload = json.loads(seen.read_text())
    assert workload["model"] == str(tmp_path) and workload["dtype"] == "float32"
    assert workload["single_prompt"] == [1, 2]
    assert workload["mixed"] == [{"prompt": [4, 5, 6], "max_tokens": 3}]


def test_a_failed_vllm_child_raises_with_its_exit_code_and_stderr(tmp_path: Path) -> None:
    python = fake_interpreter(tmp_path / "python", "echo 'no module named vllm' >&2\nexit 3\n")
    with pytest.raises(RuntimeError, match="exit code 3(.|\n)*no module named vllm"):
        vllm_runner.run_vllm(python, tmp_path, single_prompt=[1], single_tokens=1, mixed=[], threads=1)


def test_the_child_gets_vllms_cpu_settings_and_not_kvrelays_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/somewhere/kvrelay")
    child = vllm_runner.child_env(threads=2, kv_cache_gib=1)
    assert child["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and child["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert child["VLLM_CPU_KVCACHE_SPACE"] == "1" and "PYTHONPATH" not in child
    assert vllm_runner.child_env(threads=1, kv_cache_gib=1)["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert os.environ["PYTHONPATH"] == "/somewhere/kvrelay"  # the parent's is untouched

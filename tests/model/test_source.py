"""Where a model's files are: a Hugging Face repo id resolves from the local Hugging Face cache,
never from the network, and a miss says how to fetch it or where to point instead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.model.loader import load_model
from kvrelay.model.source import resolve_model_path
from tests.tiny import write_tiny_model_dir


def cached_repo(cache: Path, repo_id: str, revision: str = "0123abcd") -> Path:
    """A repo as huggingface_hub lays it out: models--owner--name/{refs/main, snapshots/REV/}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    return repo / "snapshots" / revision


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hf" / "hub"
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return cache


def test_a_repo_id_loads_from_the_local_cache_and_is_served_by_its_id(
        hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = write_tiny_model_dir(cached_repo(hf_cache, "acme/tiny-llama"))
    assert resolve_model_path("acme/tiny-llama") == snapshot
    loaded = load_model("acme/tiny-llama")
    assert loaded.name == "acme/tiny-llama" and loaded.source == str(snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_cache))  # wins over HF_HOME, as in huggingface_hub
    monkeypatch.setenv("HF_HOME", "/nowhere")
    assert resolve_model_path("acme/tiny-llama") == snapshot


def test_a_repo_of_gguf_files_resolves_to_its_one_gguf(hf_cache: Path) -> None:
    snapshot = cached_repo(hf_cache, "acme/tiny-GGUF")
    snapshot.mkdir(parents=True)
    (snapshot / "tiny.Q8_0.gguf").write_bytes(b"GGUF")
    assert resolve_model_path("acme/tiny-GGUF") == snapshot / "tiny.Q8_0.gguf"
    (snapshot / "tiny.Q4_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match="holds 2 .gguf files: pass one of them"):
        resolve_model_path("acme/tiny-GGUF")


def test_a_repo_id_missing_from_the_cache_says_kvrelay_never_downloads(hf_cache: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_path("acme/not-here")
    message = str(info.value)
    assert str(hf_cache) in message and "never downloads" in message
    assert "huggingface-cli download acme/not-here" in message and "model's directory" in message
    # The CLI says it before loading anything, with status 2 and no traceback.
    done = subprocess.run([sys.executable, "-m", "kvrelay.entrypoints.cli", "serve", "acme/not-here"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HOME": str(hf_cache.parent)})
    assert done.returncode == 2 and "never downloads" in done.stderr and "Traceback" not in done.stderr


def test_a_local_path_that_looks_like_a_repo_id_is_a_path_first(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_tiny_model_dir(tmp_path / "models" / "tiny")
    assert resolve_model_path("models/tiny") == tmp_path / "models" / "tiny"

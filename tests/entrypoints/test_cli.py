"""The `kvrelay generate` and `kvrelay chat` commands, run as real processes on a tiny model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny import write_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model_dir(tmp_path_factory.mktemp("cli_model"))


def run_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvrelay.entrypoints.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=180)


def test_generate_prints_the_completion(model_dir: Path) -> None:
    done = run_cli("generate", "t5 t6 t7", "--model", str(model_dir), "--no-chat-template",
                   "--max-tokens", "6", "--kv-cache-memory", "4MiB")
    assert done.returncode == 0, done.stderr
    words = done.stdout.split()
    assert len(words) == 6 and all(w.startswith("t") for w in words)
    assert "6 tokens" in done.stderr and "finish_reason=length" in done.stderr


def test_chat_answers_each_line_until_eof(model_dir: Path) -> None:
    done = run_cli("chat", str(model_dir), "--max-tokens", "3", "--kv-cache-memory", "4MiB",
                   stdin="t5 t6\n\n/reset\nt9 t10\n")
    assert done.returncode == 0, done.stderr
    # input() writes its "> " prompt to stdout; what is left on each line is a reply.
    replies = [r for r in (line.replace("> ", "").strip() for line in done.stdout.splitlines()) if r]
    assert len(replies) == 2 and all(len(r.split()) == 3 for r in replies)


@pytest.mark.parametrize("args, message", [
    (("generate", "hi", "--model", "/no/such/model.gguf"), "/no/such/model.gguf"),
    (("generate", "hi", "--temperature", "-1"), "temperature"),
    (("generate", "hi", "--kv-cache-memory", "lots"), "kv-cache-memory"),
    (("serve", "-tp", "0"), "tensor_parallel_size must be a positive integer, got 0"),
    (("serve", "-tp", "2", "--port", "0"), "tensor_parallel_size=2 does not divide the model's "
                                           "num_attention_heads=9"),
])
def test_bad_input_is_a_clear_error_not_a_traceback(args: tuple[str, ...], message: str) -> None:
    done = run_cli(*args)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr

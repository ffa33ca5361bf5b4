"""The `kvrelay` command itself: its help, its version, and clear errors for bad input (exit 2)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

import kvrelay
from kvrelay.entrypoints.cli import build_parser


def run_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvrelay.entrypoints.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=180)


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


def test_help_lists_every_command_and_version_prints_kvrelays() -> None:
    done = run_cli("--help")
    assert done.returncode == 0
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(commands) == {"generate", "chat", "serve", "proxy", "up", "pool", "demo", "profile", "plan"}
    assert all(f"    {name}" in done.stdout for name in commands)
    assert "later" not in done.stdout
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == kvrelay.__version__


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("command", [
    ("serve",),  # the default model: seconds to load before the port was checked
    # A model that does not exist: the port must be checked before the tokenizer is looked at.
    ("proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--routing", "kv-aware",
     "--model", "/no/such/model.gguf"),
])
def test_a_busy_port_fails_before_anything_loads_with_status_2_naming_it(command: tuple[str, ...],
                                                                          busy_port: int) -> None:
    done = run_cli(*command, "--port", str(busy_port))
    assert done.returncode == 2, done.stderr
    assert f"port {busy_port} on 127.0.0.1 is not free" in done.stderr and "--port" in done.stderr
    assert "no/such" not in done.stderr and "Traceback" not in done.stderr

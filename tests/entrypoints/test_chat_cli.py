"""`kvrelay generate` and `kvrelay chat` as real processes on a tiny model: streamed answers,
Ctrl-C under a pseudo-terminal, and a conversation that outgrows the context."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.entrypoints.terminal import CTRL_C, CTRL_D, Terminal
from tests.tiny import write_tiny_model_dir

LONG = 16000  # tokens an answer may run to: far more than a test waits for


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model_dir(tmp_path_factory.mktemp("chat_model"), max_position_embeddings=LONG + 64)


def run_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvrelay.entrypoints.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=180)


def cli_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvrelay.entrypoints.cli", *args]


def words(text: str) -> list[str]:
    return re.findall(r"\bt\d+\b", text)


def test_generate_prints_the_completion(model_dir: Path) -> None:
    done = run_cli("generate", "t5 t6 t7", "--model", str(model_dir), "--no-chat-template",
                   "--max-tokens", "6", "--ignore-eos", "--kv-cache-memory", "4MiB")
    assert done.returncode == 0, done.stderr
    assert len(words(done.stdout)) == 6
    assert "6 tokens" in done.stderr and "finish_reason=length" in done.stderr


def test_chat_answers_each_line_until_eof_and_reset_says_what_it_did(model_dir: Path) -> None:
    done = run_cli("chat", str(model_dir), "--max-tokens", "3", "--ignore-eos", "--kv-cache-memory", "4MiB",
                   "--system", "t3", stdin="t5 t6\n\n/reset\nt9 t10\n")
    assert done.returncode == 0, done.stderr
    # input() writes its "> " prompt to stdout; what is left on each line is a reply.
    replies = [r for r in (line.replace("> ", "").strip() for line in done.stdout.splitlines()) if r]
    assert len(replies) == 2 and all(len(r.split()) == 3 for r in replies)
    assert "[conversation reset: 1 exchange(s) forgotten (the system message stays)]" in done.stderr


def test_a_message_past_the_context_keeps_the_conversation_and_suggests_reset(model_dir: Path) -> None:
    too_long = " ".join(f"t{i % 200 + 2}" for i in range(80))
    done = run_cli("chat", str(model_dir), "--max-model-len", "64", "--max-tokens", "2", "--ignore-eos",
                   "--kv-cache-memory", "4MiB", stdin=f"t5 t6\n{too_long}\nt7\n")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert re.search(r"not sent: the conversation with this message is \d+ tokens and the context "
                     r"holds 64 \(max_model_len\)\. The conversation is kept: /reset starts over",
                     done.stderr)
    replies = [r for r in (line.replace("> ", "").strip() for line in done.stdout.splitlines()) if r]
    assert len(replies) == 2  # the first message and the one after the refusal were answered


@pytest.fixture
def chat(model_dir: Path) -> Iterator[Terminal]:
    terminal = Terminal(cli_argv("chat", str(model_dir), "--max-tokens", str(LONG), "--ignore-eos",
                                 "--kv-cache-memory", "32MiB", "--threads", "1"))
    try:
        yield terminal
    finally:
        terminal.close()


def test_chat_streams_and_ctrl_c_stops_the_answer_and_returns_to_the_prompt(chat: Terminal) -> None:
    chat.expect(r"> $", timeout_s=120)
    chat.send("t5 t6\n")
    streamed = chat.expect(r"t6\n(t\d+ ){5}")  # the answer is arriving while it is written
    chat.send(CTRL_C)
    rest = chat.expect(r"\[stopped \(Ctrl-C\); the answer so far stays in the conversation\]\n> ")
    assert 5 <= len(words(streamed + rest)) - 2 < LONG  # less the echoed message: stopped early
    chat.send("/reset\n")
    chat.expect(r"\[conversation reset: 1 exchange\(s\) forgotten\]\n> ")
    chat.send("t9\n")  # the engine is sound after the abort: it answers again
    chat.expect(r"(t\d+ ){3}")
    chat.send(CTRL_C)
    chat.expect(r"\[stopped.*\]\n> ")
    chat.send(CTRL_D)
    assert chat.wait() == 0
    assert "Traceback" not in chat.output


def test_generate_streams_and_ctrl_c_stops_it_with_status_130(model_dir: Path) -> None:
    terminal = Terminal(cli_argv("generate", "t5 t6", "--model", str(model_dir), "--max-tokens", str(LONG),
                                 "--ignore-eos", "--kv-cache-memory", "32MiB", "--threads", "1"))
    try:
        terminal.expect(r"(t\d+ ){5}", timeout_s=120)
        terminal.send(CTRL_C)
        assert terminal.wait() == 130
    finally:
        terminal.close()
    assert re.search(r"\[\d+ tokens in .* finish_reason=abort \(stopped by Ctrl-C\)\]", terminal.output)
    assert "Traceback" not in terminal.output

"""A command run under a pseudo-terminal, as a user's shell runs it: its controlling terminal is
the pty, so Ctrl-C typed into it reaches the command as SIGINT (stdlib only: os.openpty)."""

from __future__ import annotations

import fcntl
import os
import re
import select
import subprocess
import termios
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CTRL_C = "\x03"
CTRL_D = "\x04"


def _take_terminal() -> None:
    """In the child, after setsid: make the pty (its stdin) the controlling terminal."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """`argv` on a pty. `expect` reads until a pattern shows up; `output` is everything read."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen(list(argv), stdin=slave, stdout=slave, stderr=slave, cwd=ROOT,
                                     env={**os.environ, **(env or {})}, start_new_session=True,
                                     preexec_fn=_take_terminal)
        os.close(slave)
        self.output = ""
        self._seen = 0  # `expect` searches the output from here on

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def expect(self, pattern: str, timeout_s: float = 60.0) -> str:
        """Read until `pattern` (a regex) matches output not matched before; the output from the
        previous match to the end of this one. AssertionError with the output on a timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            match = re.compile(pattern).search(self.output, self._seen)
            if match is not None:
                start, self._seen = self._seen, match.end()
                return self.output[start:match.end()]
            left = deadline - time.monotonic()
            assert left > 0, f"{pattern!r} did not show up in {timeout_s} s; output:\n{self.output}"
            self._read(min(left, 0.5))

    def _read(self, timeout_s: float) -> None:
        ready, _, _ = select.select([self.master], [], [], timeout_s)
        if not ready:
            return
        try:
            chunk = os.read(self.master, 65536)
        except OSError:  # EIO: the child closed the terminal
            chunk = b""
        if not chunk:
            time.sleep(0.05)
        self.output += chunk.decode(errors="replace").replace("\r\n", "\n")

    def wait(self, timeout_s: float = 60.0) -> int:
        """The exit status, reading the rest of the output meanwhile."""
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, f"still running after {timeout_s} s:\n{self.output}"
            self._read(0.2)
        self._read(0.1)
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)

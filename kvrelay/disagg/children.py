"""`kvrelay up`'s children: processes in their own process group, logging to a file, with a
health URL; started, waited for and stopped together (SIGTERM to each group, SIGKILL after a grace
period). A child dies with the launcher even when the launcher is killed outright (Linux:
PR_SET_PDEATHSIG)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


class ClusterError(RuntimeError):
    """A child failed to start, did not become healthy, or died."""


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the launcher dies, however it dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class ChildProcess:
    """One child in its own process group, logging to a file, with a health URL."""

    def __init__(self, name: str, argv: list[str], url: str, log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.url, self.log_path = name, argv, url, log_path
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True, preexec_fn=_die_with_parent)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def exit_code(self) -> int | None:
        """None while running (or never started)."""
        return self.process.poll() if self.process is not None else None

    def is_healthy(self, timeout: float = 2.0) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=timeout, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, num_lines: int = 25) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-num_lines:]) or "(empty log)"

    def signal_group(self, sig: int) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, sig)  # the child's pid is its group id (own session)
        except (ProcessLookupError, PermissionError):
            pass


def stop_children(children: list[ChildProcess], grace_period: float) -> None:
    """SIGTERM every child's group, wait up to `grace_period`, then SIGKILL what is left."""
    for child in children:
        if child.exit_code() is None:
            child.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_period
    for child in children:
        if child.process is None:
            continue
        try:
            child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for child in children:
        child.signal_group(signal.SIGKILL)  # the leader if hung, and any straggler in its group
        if child.process is not None:
            child.process.wait()


def wait_healthy(children: list[ChildProcess], timeout_s: float) -> None:
    """Block until every child answers /health; ClusterError (with its log) if one exits first
    or the time runs out."""
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    while pending:
        for child in list(pending):
            code = child.exit_code()
            if code is not None:
                raise ClusterError(f"{child.name} exited with code {code} while starting; "
                                   f"last lines of its log:\n{child.log_tail()}")
            if child.is_healthy():
                pending.remove(child)
        if pending and time.monotonic() > deadline:
            tails = "\n".join(f"--- {c.name}:\n{c.log_tail()}" for c in pending)
            raise ClusterError(f"not healthy after {timeout_s:.0f} s: "
                               f"{', '.join(c.name for c in pending)}\n{tails}")
        if pending:
            time.sleep(0.25)

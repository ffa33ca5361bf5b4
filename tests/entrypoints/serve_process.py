"""Run `kvrelay serve` as a real subprocess on a free loopback port, for HTTP tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeProcess:
    """`kvrelay serve MODEL_DIR ...` with its output in `log_path`; `stop()` asserts a clean exit."""

    def __init__(self, model_dir: Path, log_path: Path, *extra_args: str,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "kvrelay.entrypoints.cli", "serve", str(model_dir),
               "--host", "127.0.0.1", "--port", str(self.port), "--threads", "1", *extra_args]
        full_env = {k: v for k, v in os.environ.items() if k != "KVRELAY_API_KEY"}
        full_env.update(env or {})
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=full_env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvrelay serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise TimeoutError(f"kvrelay serve was not healthy within {timeout_s:.0f} s:\n{self.log()}")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait, and return the exit status (killing it if it hangs)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise AssertionError(f"kvrelay serve ignored SIGTERM for {timeout_s:.0f} s:\n{self.log()}") \
                    from None
        return int(self.proc.returncode)

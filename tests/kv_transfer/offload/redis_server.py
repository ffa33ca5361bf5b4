"""A real Redis: `redis-server` from PATH on a loopback port, with persistence off.

`scripts/install_redis.sh` (run by `make test`) installs it; without it a test that needs it skips."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """`port`: 0 picks a free one; a given port restarts a server (empty) at its old address."""

    def __init__(self, port: int = 0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not on PATH (run scripts/install_redis.sh, as `make test` does)")
        self.port = port or _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()

    def client(self):  # type: ignore[no-untyped-def]
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}")
            try:
                if self.client().ping():
                    return
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not answer PING within 20 s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

"""A real Redis for the offload tests: `redis-server` from PATH on a free loopback port, with
persistence off, started once per session (and a private one for tests that kill it).

`scripts/install_redis.sh` (run by `make test`) installs it; without it the Redis tests skip."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from tests.kv_transfer.offload.helpers import LIVE_LLMS
from tests.kv_transfer.offload.mooncake_master import mooncake_master  # noqa: F401 - a fixture


@pytest.fixture(autouse=True)
def no_offload_thread_outlives_its_test() -> Iterator[None]:
    """Shut down every engine the test built; then none of their store, load or lookup threads
    may be left."""
    yield
    while LIVE_LLMS:
        LIVE_LLMS.pop().shutdown()
    left = [t.name for t in threading.enumerate() if t.name.startswith("kvrelay-offload")]
    assert not left, f"offload threads left behind: {left}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not on PATH (run scripts/install_redis.sh, as `make test` does)")
        self.port = _free_port()
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


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session server, emptied for this test."""
    redis_server.client().flushall()
    return redis_server.url


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A server of this test's own, which the test may stop."""
    server = RedisServer()
    yield server
    server.stop()

"""A real Redis for the offload tests: `redis-server` from PATH on a free loopback port, with
persistence off, started once per session (and a private one for tests that kill it).

`scripts/install_redis.sh` (run by `make test`) installs it; without it the Redis tests skip."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from tests.kv_transfer.offload.helpers import LIVE_LLMS
from tests.kv_transfer.offload.mooncake_master import mooncake_master  # noqa: F401 - a fixture
from tests.kv_transfer.offload.redis_server import RedisServer


@pytest.fixture(autouse=True)
def no_offload_thread_outlives_its_test() -> Iterator[None]:
    """Shut down every engine the test built; then none of their store, load or lookup threads
    may be left."""
    yield
    while LIVE_LLMS:
        LIVE_LLMS.pop().shutdown()
    left = [t.name for t in threading.enumerate() if t.name.startswith("kvrelay-offload")]
    assert not left, f"offload threads left behind: {left}"


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

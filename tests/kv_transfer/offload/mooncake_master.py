"""A real `mooncake_master` for the Mooncake Store tests, on free loopback ports, started and
stopped by the tests (the wheel of `kvrelay[mooncake]` ships the binary next to Python).

Without a loadable wheel the tests skip, saying why."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def require_mooncake_store() -> str:
    """The mooncake_master binary; skips the test where the wheel cannot load here."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as e:
        pytest.skip(f"mooncake.store does not load ({e}); pip install 'kvrelay[mooncake]' and run "
                    "sh scripts/install_mooncake_deps.sh")
    next_to_python = os.path.dirname(sys.executable)
    binary = shutil.which("mooncake_master", path=next_to_python) or shutil.which("mooncake_master")
    if binary is None:
        pytest.skip("the Mooncake wheel is installed but mooncake_master is not next to python nor on PATH")
    return binary


class MooncakeMaster:
    """`mooncake_master` on 127.0.0.1; `stop()` and `start()` again keep the same port."""

    def __init__(self, *extra_flags: str, start: bool = True) -> None:
        self.binary = require_mooncake_store()
        self.port = _free_port()
        self.extra_flags = extra_flags
        self.process: subprocess.Popen[bytes] | None = None
        if start:
            self.start()

    @property
    def url(self) -> str:
        return f"mooncakestore://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
             f"--metrics_port={_free_port()}", "--enable_metric_reporting=false", *self.extra_flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.process.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("mooncake_master did not listen within 20 s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture
def mooncake_master() -> Iterator[MooncakeMaster]:
    """A master of this test's own (the test may stop and restart it)."""
    master = MooncakeMaster()
    yield master
    master.stop()

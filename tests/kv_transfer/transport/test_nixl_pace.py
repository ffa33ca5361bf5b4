"""The NIXL transport's progress thread: fast while something can happen, slow when idle."""

from __future__ import annotations

import time

import pytest

from tests.kv_transfer.transport.helpers import make_pair, require_backend

pytestmark = pytest.mark.timeout(120)


class _PendingRead:
    """Stands for a read the progress thread checks and finds unfinished."""

    def _check(self) -> bool:
        return False


def test_the_progress_thread_polls_slowly_only_when_nothing_can_happen() -> None:
    require_backend("nixl")
    from kvrelay.kv_transfer.transport import nixl

    p, d, _, _ = make_pair("nixl")
    try:
        fast, idle = p._progress_interval_s, p._idle_interval_s
        assert idle == nixl.IDLE_INTERVAL_S > fast
        assert p._pace() == fast  # a bare transport expects peers until told otherwise
        p.expect_remote_access(False)
        assert p._pace() == fast  # lingers a moment for what just ended
        p._busy_until = time.monotonic() - 1
        assert p._pace() == idle
        p.expect_remote_access(True)  # P took a lease: D may read at any moment
        assert p._pace() == fast
        d.expect_remote_access(False)
        d._busy_until = time.monotonic() - 1
        assert d._pace() == idle
        pending = _PendingRead()  # one of D's own reads in flight, for as long as the test says
        with d.lock:
            d._in_flight.add(pending)
        assert d._pace() == fast
        with d.lock:
            d._in_flight.discard(pending)
        assert d._pace() == idle
        handle = d.read_blocks("engine-p", [0, 1], [0, 1], b"paced:1")  # a real one: idle again after
        deadline = time.monotonic() + 30
        while handle.poll().name == "PENDING" and time.monotonic() < deadline:
            time.sleep(0.001)
        assert handle.poll().name == "DONE"
        handle.release()
        assert not d._in_flight and d._pace() == idle
    finally:
        d.close()
        p.close()

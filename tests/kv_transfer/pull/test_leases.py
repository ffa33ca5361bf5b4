"""P's lease table counts its readers: a P rank that several D ranks read from (D's TP larger than
P's) frees only when each of them read or released, and one nobody reads from frees on a release
that arrived even before the lease was registered."""

from __future__ import annotations

import time

from kvrelay.kv_transfer.p2p.lease_ids import make_lease_id
from kvrelay.kv_transfer.pull.leases import LeaseTable
from kvrelay.kv_transfer.pull.meta import LeaseSpec, ReleaseRequest


def _table() -> LeaseTable:
    return LeaseTable(lease_seconds=60.0, checksum_fn=lambda block_ids, ranges: [0] * len(block_ids))


def _lease(req_id: str) -> LeaseSpec:
    now_ms = int(time.time() * 1000)
    return LeaseSpec(req_id=req_id, lease_id=make_lease_id(now_ms), block_ids=[1, 2], prompt_digest=b"d",
                     expiry_ms=now_ms + 60_000)


def test_a_lease_read_by_two_d_ranks_ends_on_the_second_notification() -> None:
    table = _table()
    table.add(_lease("r"))
    table.on_notification(b"r:2")
    assert table.take_ended() == (set(), 0)
    table.on_notification(b"r:2")
    assert table.take_ended() == ({"r"}, 0)


def test_one_reader_read_and_the_other_released_ends_the_lease() -> None:
    table = _table()
    spec = _lease("r")
    table.add(spec)
    table.release(ReleaseRequest(request_id="r", lease_id=spec.lease_id, num_consumers=2))
    assert table.take_ended() == (set(), 0)
    table.on_notification(b"r:2")
    assert table.take_ended() == ({"r"}, 0)


def test_a_release_before_the_lease_is_registered_ends_it_when_it_is() -> None:
    table = _table()
    spec = _lease("r")
    table.release(ReleaseRequest(request_id="r", lease_id=spec.lease_id, num_consumers=1))
    table.add(spec)
    assert table.take_ended() == ({"r"}, 0)

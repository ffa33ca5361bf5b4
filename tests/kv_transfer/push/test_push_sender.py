"""P's side of a push registration, without an engine: D's stated bounds win over P's longer ones,
so D's wait-out after giving up holds even when the two instances are configured differently;
between TP sizes P takes a registration only as its own plan says, and frees a request only once
every D rank that reads from it registered and ended, or declined."""

from __future__ import annotations

import time
from typing import Any

from kvrelay.kv_transfer.base import KVCacheSpec
from kvrelay.kv_transfer.p2p.settings import PushConfig
from kvrelay.kv_transfer.push.meta import (
    PUSH_CANCELLED,
    PUSH_FAILED,
    PUSH_REFUSED,
    PUSH_WAITING,
    PUSH_WRITTEN,
    PushCancel,
    PushRef,
    PushRegister,
)
from kvrelay.kv_transfer.push.sender import PushSender
from kvrelay.kv_transfer.push.sender_state import LEASE_EXPIRED, Job, Registration
from kvrelay.kv_transfer.transport.base import ByteRange, RegionLayout

BLOCK_SIZE = 4


def sender(**config: float) -> PushSender:
    spec = KVCacheSpec(block_size=BLOCK_SIZE, num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32")
    layout = RegionLayout(("layer.0",), 8, 2 * BLOCK_SIZE * 4 * 4, (0,), "cpu")
    return PushSender(transport=None, kv_spec=spec, layout=layout,  # type: ignore[arg-type]
                      config=PushConfig(backend="tcp", **config), kv_layers=[])


def registration(transfer_id: str, age_s: float, **fields: Any) -> PushRegister:
    fields = {"block_bytes": 128, **fields}
    return PushRegister(
        transfer_id=transfer_id, registration_id=f"r-{transfer_id}-{fields.get('tp_rank', 0)}", engine_id="d",
        instance_id="i", backend="tcp", agent_metadata=b"", layer_names=["layer.0"], num_blocks=8,
        base_addresses=[0], device="cpu", block_size=BLOCK_SIZE, fingerprint_digest="",
        prompt_digest=b"x", num_prompt_tokens=2 * BLOCK_SIZE, first_block=0, block_ids=[3, 5],
        sent_at=time.time() - age_s, **fields)


def test_a_registration_older_than_ds_timeout_is_refused_though_ps_is_longer() -> None:
    p = sender(transfer_timeout_seconds=30.0)
    refused = p.register(registration("t-old", age_s=3.0, max_age_s=1.0), None)
    assert refused.state == PUSH_REFUSED and "after it was sent" in refused.error
    assert not p.has_pending()  # nothing kept: P will never write into those blocks
    assert p.register(registration("t-fresh", age_s=3.0, max_age_s=5.0), None).state == PUSH_WAITING
    # A D that states no bound (an older kvrelay) gets P's own.
    assert p.register(registration("t-legacy", age_s=3.0), None).state == PUSH_WAITING


def test_the_lease_is_the_shorter_of_ps_and_ds_and_a_stale_heartbeat_renews_nothing() -> None:
    p = sender(lease_seconds=30.0, heartbeat_seconds=5.0, transfer_timeout_seconds=30.0)
    status = p.register(registration("t-a", age_s=0.0, max_age_s=1.0, max_lease_s=0.6), None)
    assert status.state == PUSH_WAITING and status.lease_s == 0.6
    reg = p._waiting["t-a"].registrations[0]
    expires = reg.expires
    ref = PushRef("t-a", "r-t-a-0")
    p.heartbeat([ref], sent_at=time.time() - 2.0, max_age_s=1.0)  # older than D's timeout
    assert reg.expires == expires
    p.heartbeat([ref], sent_at=time.time(), max_age_s=1.0)
    assert expires < reg.expires <= time.monotonic() + 0.6


def tp2_rank0_sender() -> PushSender:
    """Rank 0 of a tp 2 prefill instance of a 2-KV-head model: it holds head 0 (64 bytes of K and
    64 of V a block)."""
    spec = KVCacheSpec(block_size=BLOCK_SIZE, num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32",
                       fingerprint={"num_kv_heads": 2}, tp_rank=0, tp_size=2)
    layout = RegionLayout(("layer.0",), 8, 2 * BLOCK_SIZE * 4 * 4, (0,), "cpu")
    return PushSender(transport=None, kv_spec=spec, layout=layout,  # type: ignore[arg-type]
                      config=PushConfig(backend="tcp"), kv_layers=[])


def test_p_takes_a_registration_only_as_its_own_plan_says() -> None:
    p = tp2_rank0_sender()
    head = ByteRange(0, 0, 64), ByteRange(64, 128, 64)  # D tp 1 holds both heads: head 0 goes first
    ok = registration("t-ok", age_s=0.0, tp_size=1, tp_rank=0, ranges=list(head), block_bytes=256)
    assert p.register(ok, None).state == PUSH_WAITING
    refusals = {
        "cannot take KV from this tensor_parallel_size 2 prefill instance": dict(tp_size=3, tp_rank=0),
        "the plan says": dict(tp_size=1, tp_rank=0, block_bytes=256),  # whole blocks: wrong ranges
        "reads none of its KV heads from rank 0": dict(tp_size=2, tp_rank=1),  # head 1 is on P rank 1
        "the plan 256": dict(tp_size=1, tp_rank=0, ranges=list(head), block_bytes=128),
    }
    for i, (why, stated) in enumerate(refusals.items()):
        status = p.register(registration(f"t-{i}", age_s=0.0, **stated), None)
        assert status.state == PUSH_REFUSED and why in status.error, status.error
    assert "tensor_parallel_size 3 decode instance" in p.register(
        registration("t-3", age_s=0.0, tp_size=3), None).error  # both sizes named
    # a second D size for the same request, or the same D rank twice, is refused too
    assert "already" in p.register(registration("t-ok", age_s=0.0, tp_size=2, tp_rank=0), None).error
    again = registration("t-ok", age_s=0.0, tp_size=1, tp_rank=0, ranges=list(head), block_bytes=256)
    assert "already registered" in p.register(again, None).error


def _finished_job(expected: set[int]) -> Job:
    job = Job("t", "r", 2 * BLOCK_SIZE, b"x", [1, 2], finished=True, complete=True)
    job.readers.fix_tp(len(expected) or 1, frozenset(expected))
    return job


def test_a_job_ends_once_every_reader_registered_and_ended_or_declined() -> None:
    now = time.monotonic()
    job = _finished_job({0, 1})
    written = Registration(registration("t", age_s=0.0), "d/0", 1.0, expires=now + 60, match_by=now + 60,
                           num_layers=1, final_done=True)
    job.readers.registrations[0] = written
    assert job.end_reason(now) is None  # D rank 1 neither registered nor declined yet
    job.readers.declined.add(1)
    assert job.end_reason(now) == (PUSH_FAILED, "the decode instance gave up before registering")
    both = _finished_job({0, 1})
    both.readers.registrations = {0: written, 1: written}
    assert both.end_reason(now) == (PUSH_WRITTEN, "")
    nobody = _finished_job(set())  # a P rank no D rank reads from, told so by the plan's D rank
    assert nobody.end_reason(now) == (PUSH_CANCELLED, "no decode rank reads from this rank")
    late = _finished_job({0, 1})
    late.hold_expires = now - 1
    assert late.end_reason(now) == LEASE_EXPIRED  # nobody registered before the lease ended


def test_a_decline_before_the_request_starts_is_kept_for_it() -> None:
    p = tp2_rank0_sender()
    status = p.cancel(PushCancel(transfer_id="t-x", registration_id="never", tp_size=1, tp_rank=0))
    assert status.state == PUSH_CANCELLED
    readers = p._waiting["t-x"]
    assert readers.d_tp == 1 and readers.declined == {0} and readers.accounted
    assert not p.has_pending()  # nothing to write, nothing held

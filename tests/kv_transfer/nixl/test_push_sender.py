"""P's side of a push registration, without an engine: D's stated bounds win over P's longer ones,
so D's wait-out after giving up holds even when the two instances are configured differently."""

from __future__ import annotations

import time

from kvrelay.kv_transfer.base import KVCacheSpec
from kvrelay.kv_transfer.connectors.nixl_push import PushConfig
from kvrelay.kv_transfer.connectors.nixl_push_meta import PUSH_REFUSED, PUSH_WAITING, PushRef, PushRegister
from kvrelay.kv_transfer.connectors.nixl_push_sender import PushSender
from kvrelay.kv_transfer.transport.base import RegionLayout

BLOCK_SIZE = 4


def sender(**config: float) -> PushSender:
    spec = KVCacheSpec(block_size=BLOCK_SIZE, num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32")
    layout = RegionLayout(("layer.0",), 8, 2 * BLOCK_SIZE * 4 * 4, (0,), "cpu")
    return PushSender(transport=None, kv_spec=spec, layout=layout,  # type: ignore[arg-type]
                      config=PushConfig(backend="tcp", **config), kv_layers=[])


def registration(transfer_id: str, age_s: float, **bounds: float) -> PushRegister:
    return PushRegister(
        transfer_id=transfer_id, registration_id=f"r-{transfer_id}", engine_id="d", instance_id="i",
        backend="tcp", agent_metadata=b"", layer_names=["layer.0"], num_blocks=8, block_bytes=128,
        base_addresses=[0], device="cpu", block_size=BLOCK_SIZE, fingerprint_digest="",
        prompt_digest=b"x", num_prompt_tokens=2 * BLOCK_SIZE, first_block=0, block_ids=[3, 5],
        sent_at=time.time() - age_s, **bounds)


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
    ref = PushRef("t-a", "r-t-a")
    p.heartbeat([ref], sent_at=time.time() - 2.0, max_age_s=1.0)  # older than D's timeout
    assert reg.expires == expires
    p.heartbeat([ref], sent_at=time.time(), max_age_s=1.0)
    assert expires < reg.expires <= time.monotonic() + 0.6

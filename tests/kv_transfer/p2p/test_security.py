"""NixlConnector security: authenticated side channel, signed params, refusals of bad peers.
A refused transfer must end in a local recompute (or a clear error with policy "fail"), never in
reading KV that is not the prompt's."""

from __future__ import annotations

import logging
import math
import random
import time
from typing import TYPE_CHECKING

import msgspec
import pytest
import zmq

from kvrelay.config import EngineConfig
from kvrelay.kv_transfer.base import KVCacheSpec, KVConnectorRole
from kvrelay.kv_transfer.config import KVTransferConfig
from kvrelay.kv_transfer.factory import create_connector
from kvrelay.kv_transfer.p2p import security
from kvrelay.kv_transfer.p2p.handshake import HandshakeRequest
from kvrelay.kv_transfer.p2p.settings import NixlConfig
from kvrelay.kv_transfer.side_channel import (
    ReplayGuard,
    SideChannelClient,
    SideChannelError,
    SideChannelServer,
    new_envelope,
    seal,
    unseal,
)
from tests.kv_transfer.p2p.pd import BLOCK_SIZE, free_port, prompt, reference_tokens

if TYPE_CHECKING:
    import torch

SECRET = "s3cret-for-tests-0123456789"


def _sign(params: dict, tokens: list[int], secret: str | None = SECRET) -> dict:  # type: ignore[type-arg]
    keys = security.Keys(b"", security._derive((secret or "").encode(), b"kvrelay kv_transfer_params v1"),
                         secret is not None)
    return {**params, "signature": security.sign_params(params, tokens, keys.params)}


# ---------------------------------------------------------------- side channel


def _echo_server(key: bytes, port: int) -> SideChannelServer:
    return SideChannelServer("127.0.0.1", port, key, "inst", {
        "handshake": lambda body: ("handshake_reply",
                                   HandshakeRequest(engine_id="p", expected_engine_id="p"))})


def test_side_channel_round_trip_is_authenticated_both_ways() -> None:
    key = b"k" * 32
    port = free_port()
    server = _echo_server(key, port)
    ctx = zmq.Context()
    client = SideChannelClient(ctx, "127.0.0.1", port, key)
    try:
        reply = client.call("handshake", HandshakeRequest(engine_id="d", expected_engine_id="p"), 5)
        assert reply.kind == "handshake_reply" and reply.sender == "inst"
    finally:
        client.close()
        server.close()
        ctx.term()


def test_side_channel_refuses_a_client_with_the_wrong_secret() -> None:
    port = free_port()
    server = _echo_server(b"right" * 8, port)
    ctx = zmq.Context()
    client = SideChannelClient(ctx, "127.0.0.1", port, b"wrong" * 8)
    try:
        with pytest.raises(SideChannelError, match="authentication failed.*KVRELAY_KV_SECRET"):
            client.call("handshake", HandshakeRequest(engine_id="d", expected_engine_id="p"), 5)
    finally:
        client.close()
        server.close()
        ctx.term()


def test_a_tampered_or_replayed_message_is_refused() -> None:
    key = b"k" * 32
    frames = seal(key, new_envelope("pin", HandshakeRequest(engine_id="d", expected_engine_id="p"), ""))
    assert unseal(key, frames).kind == "pin"
    with pytest.raises(SideChannelError, match="authentication failed"):
        unseal(key, [frames[0].replace(b"pin", b"pim"), frames[1]])
    guard = ReplayGuard()
    envelope = unseal(key, frames)
    assert guard.check(envelope) is None
    assert guard.check(envelope) == "replayed message"
    stale = msgspec.structs.replace(envelope, sent_at=time.time() - 3600, nonce=b"other")
    assert "stale" in (guard.check(stale) or "")


# ---------------------------------------------------------------- start-up checks


def _connector(kv_ip: str, extra: dict | None = None, role: KVConnectorRole = KVConnectorRole.SCHEDULER):  # type: ignore[no-untyped-def,type-arg]
    transfer = KVTransferConfig.from_any({"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                                          "kv_ip": kv_ip, "kv_connector_extra_config": extra or {}})
    spec = KVCacheSpec(block_size=4, num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")
    return create_connector(EngineConfig(kv_transfer=transfer), role, spec)


def test_non_loopback_side_channel_without_a_secret_is_a_startup_error(monkeypatch) -> None:
    monkeypatch.delenv("KVRELAY_KV_SECRET", raising=False)
    with pytest.raises(ValueError, match="no KV transfer secret.*KVRELAY_KV_SECRET"):
        _connector("0.0.0.0")
    monkeypatch.setenv("KVRELAY_KV_SECRET", SECRET)
    _connector("0.0.0.0")  # with a secret it may listen on every interface


def test_secret_file_and_bad_extra_config_are_checked(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KVRELAY_KV_SECRET", raising=False)
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ValueError, match="at least 16"):
        _connector("0.0.0.0", {"secret_file": str(short)})
    good = tmp_path / "good"
    good.write_text(SECRET + "\n")
    assert security.load_keys(str(good)).authenticated
    with pytest.raises(ValueError, match="cannot read"):
        _connector("127.0.0.1", {"secret_file": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="unknown NixlConnector extra config key.*'lease_secs'"):
        NixlConfig.from_extra_config({"lease_secs": 3})
    with pytest.raises(ValueError, match="lease_seconds must be a number > 0"):
        NixlConfig.from_extra_config({"lease_seconds": 0})
    with pytest.raises(ValueError, match="backend must be one of"):
        NixlConfig.from_extra_config({"backend": "carrier-pigeon"})


# ---------------------------------------------------------------- params


def test_params_check_refuses_unsigned_forged_expired_and_other_prompts() -> None:
    keys = security.Keys(b"", b"p" * 32, True)
    tokens = prompt(9)
    params = {"remote_request_id": "r", "remote_engine_id": "e", "remote_lease_id": "1-ab",
              "remote_block_ids": [3, 4, 5], "remote_num_tokens": 9, "remote_block_size": 4,
              "remote_lease_expiry_ms": int(time.time() * 1000) + 10_000, "remote_host": "127.0.0.1",
              "remote_port": 1}
    signed = {**params, "signature": security.sign_params(params, tokens, keys.params)}
    assert security.check_params(signed, tokens, 4, keys.params) is None
    assert "unsigned" in (security.check_params(params, tokens, 4, keys.params) or "")
    forged = {**signed, "remote_block_ids": [7, 4, 5]}
    assert "signature is invalid" in (security.check_params(forged, tokens, 4, keys.params) or "")
    other_prompt = [*tokens[:-1], tokens[-1] + 1]
    assert "signature is invalid" in (security.check_params(signed, other_prompt, 4, keys.params) or "")
    assert "expired" in (security.check_params(signed, tokens, 4, keys.params, now=time.time() + 60) or "")
    assert "tokens" in (security.check_params(signed, tokens[:-1], 4, keys.params) or "")
    assert "block size" in (security.check_params(signed, tokens, 8, keys.params) or "")


def test_a_bad_signature_under_another_key_id_says_p_and_d_hold_different_secrets(monkeypatch) -> None:
    monkeypatch.setenv("KVRELAY_KV_SECRET", SECRET)
    p_keys = security.load_keys(None)
    monkeypatch.setenv("KVRELAY_KV_SECRET", "another-secret-0123456789")
    d_keys = security.load_keys(None)
    monkeypatch.delenv("KVRELAY_KV_SECRET")
    open_keys = security.load_keys(None)
    assert len(p_keys.key_id) == 16 and p_keys.key_id != d_keys.key_id and open_keys.key_id == ""
    assert p_keys.key_id not in SECRET and p_keys.key_id not in (p_keys.params.hex() + p_keys.channel.hex())
    tokens = prompt(9)
    params = security.signed_params({
        "remote_request_id": "r", "remote_engine_id": "e", "remote_lease_id": "1-ab",
        "remote_block_ids": [3, 4, 5], "remote_num_tokens": 9, "remote_block_size": 4,
        "remote_lease_expiry_ms": int(time.time() * 1000) + 10_000, "remote_host": "127.0.0.1",
        "remote_port": 1}, tokens, p_keys)
    assert params[security.KEY_ID_FIELD] == p_keys.key_id
    assert security.check_params(params, tokens, 4, p_keys.params, key_id=p_keys.key_id) is None

    def refusal(keys: security.Keys, sent: dict) -> str:  # type: ignore[type-arg]
        return security.check_params(sent, tokens, 4, keys.params, key_id=keys.key_id) or ""

    different = refusal(d_keys, params)
    assert f"P signed with key id {p_keys.key_id}, this instance has key id {d_keys.key_id}" in different
    assert "most likely hold different KV transfer secrets" in different and "KVRELAY_KV_SECRET" in different
    assert "P signed with key id" in refusal(open_keys, params) and "this instance has no secret" in \
        refusal(open_keys, params)
    # The same secret and a bad signature: forged or altered, not a configuration mistake.
    altered = refusal(p_keys, {**params, "remote_block_ids": [7, 4, 5]})
    assert "forged, altered" in altered and "different" not in altered


def test_checksum_sees_any_changed_word_and_swapped_blocks() -> None:
    import torch

    kv = [torch.randn(8, 2, 2, 4, 16) for _ in range(2)]
    sums = security.block_digests(kv, [1, 2, 3])
    assert sums == security.block_digests([t.clone() for t in kv], [1, 2, 3])
    kv[1][2, 1, 0, 3, 5] += 1e-3
    assert security.block_digests(kv, [1, 2, 3])[1] != sums[1]
    assert security.block_digests(kv, [1, 2, 3])[0] == sums[0]
    assert security.block_digests(kv, [3, 1]) != [sums[0], sums[2]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checksum_is_the_wrapping_sum_of_each_blocks_words_folded_over_layers(dtype: str) -> None:
    import torch

    kv = [(torch.randn(6, 2, 2, 4, 16) * 1e9).to(getattr(torch, dtype)) for _ in range(3)]
    block_ids = [4, 0, 1, 2, 5]  # runs [4], [0, 1, 2], [5]
    expected = []
    for b in block_ids:
        digest = 0
        for layer in kv:
            words = layer[b].contiguous().view(-1).view(torch.uint8).view(torch.int64).tolist()
            digest = (digest * 1000003 + sum(words)) % 2**64
        expected.append(digest - 2**64 if digest >= 2**63 else digest)
    assert security.block_digests(kv, block_ids) == expected


def test_checksum_of_a_head_slice_matches_the_same_heads_held_alone() -> None:
    """P (2 heads a block) checksums head 1's K and V ranges; D, holding head 1 alone, checksums
    its whole block: the same bytes, the same digest."""
    import torch

    p_kv = [torch.randn(6, 2, 2, 4, 16) for _ in range(2)]  # [num_blocks, 2, H_kv, block_size, D]
    d_kv = [layer[:, :, 1:2].contiguous() for layer in p_kv]  # head 1 only
    head_bytes = 4 * 16 * 4
    p_ranges = [(head_bytes, head_bytes), (3 * head_bytes, head_bytes)]  # K and V of head 1
    assert security.block_digests(p_kv, [3, 0], p_ranges) == security.block_digests(d_kv, [3, 0])
    d_ranges = [(0, head_bytes), (head_bytes, head_bytes)]
    assert security.block_digests(d_kv, [3, 0], d_ranges) == security.block_digests(d_kv, [3, 0])
    p_kv[1][0, 0, 0, 0, 0] += 1.0  # head 0: outside the slice
    assert security.block_digests(p_kv, [3, 0], p_ranges) == security.block_digests(d_kv, [3, 0])
    p_kv[1][0, 1, 1, 0, 0] += 1.0  # head 1's V
    assert security.block_digests(p_kv, [3, 0], p_ranges)[1] != security.block_digests(d_kv, [3, 0])[1]


def _random_layers(dtype: str, num_layers: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Random bytes viewed as `dtype`: every bit pattern, so the sums overflow and wrap."""
    import torch

    torch_dtype = getattr(torch, dtype)
    itemsize = torch.empty(0, dtype=torch_dtype).element_size()
    layers = []
    for _ in range(num_layers):
        raw = torch.randint(0, 256, (shape[0], math.prod(shape[1:]) * itemsize), dtype=torch.uint8)
        layers.append(raw.view(torch_dtype).view(shape))
    return layers


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn", "uint8"])
def test_a_layer_by_layer_fold_equals_block_digests_bit_for_bit(dtype: str) -> None:
    import torch

    if not hasattr(torch, dtype):
        pytest.skip(f"this torch has no {dtype}")
    # uint8 with an odd head size: block bytes not a multiple of 8 (the widening path)
    shape = (12, 2, 2, 4, 7) if dtype == "uint8" else (12, 2, 2, 4, 16)
    kv = _random_layers(dtype, 5, shape)
    block_ids = [7, 0, 1, 2, 9, 10, 4]
    fold = security.DigestFold(kv, len(block_ids))
    rng = random.Random(0)
    for _ in range(20):  # layers finish blocks in any order and any number of steps
        layer = rng.randrange(len(kv))
        fold.fold(layer, block_ids, fold.folded[layer] + rng.randrange(3))
    assert fold.digests(block_ids) == security.block_digests(kv, block_ids)
    assert security.DigestFold(kv, len(block_ids)).digests(block_ids, first=3) == \
        security.block_digests(kv, block_ids[3:])


def test_sums_taken_as_writes_land_equal_block_digests_and_a_rewrite_replaces_its_sums() -> None:
    kv = _random_layers("bfloat16", 3, (10, 2, 2, 4, 16))
    block_ids = [6, 2, 3, 8]
    landed = security.LandedSums(kv, block_ids)
    landed.record([2, 3], [0, 1, 2])
    assert landed.digests() is None  # blocks 6 and 8 never landed
    landed.record([8, 6], [2])
    landed.record([6, 8], [0, 1])
    kv[1][8].view(-1)[5] += 1  # a block written again (a chunk's partial last block) ...
    landed.record([8], [1])  # ... replaces its sums for that layer
    assert landed.digests() == security.block_digests(kv, block_ids)


def test_ranged_folds_and_landed_sums_cover_exactly_the_byte_ranges() -> None:
    """A push of one KV head's slice: P folds its ranges of each block, D sums its own ranges
    (other offsets) as writes land; both equal block_digests of those ranges, and a byte outside
    them changes nothing."""
    import torch

    p_kv = _random_layers("float32", 3, (10, 2, 2, 4, 8))  # [n, 2, 2 heads, bs, D]
    d_kv = [torch.zeros(10, 2, 1, 4, 8) for _ in p_kv]  # one head
    head = 4 * 8 * 4
    p_ranges, d_ranges = [(head, head), (3 * head, head)], [(0, head), (head, head)]
    p_ids, d_ids = [5, 1, 2], [0, 7, 3]
    for p_layer, d_layer in zip(p_kv, d_kv, strict=True):
        d_layer[d_ids] = p_layer[p_ids, :, 1:2]
    fold = security.DigestFold(p_kv, len(p_ids), p_ranges)
    fold.fold(1, p_ids, 2)
    want = fold.digests(p_ids)
    assert want == security.block_digests(p_kv, p_ids, p_ranges)
    landed = security.LandedSums(d_kv, d_ids, d_ranges)
    landed.record(d_ids, [0, 1, 2])
    assert landed.digests() == want
    p_kv[0][5, 0, 0, 0, 0] += 1.0  # head 0: not pushed, not counted
    assert security.block_digests(p_kv, p_ids, p_ranges) == want


# ---------------------------------------------------------------- end to end


@pytest.fixture
def secret(monkeypatch) -> str:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KVRELAY_KV_SECRET", SECRET)
    return SECRET


@pytest.mark.parametrize("tamper", ["unsigned", "forged", "expired", "out_of_range", "other_lease",
                                    "other_prompt"])
def test_bad_params_recompute_locally(make_pd, reference, secret, tamper, caplog) -> None:
    pd = make_pd(p_extra={"lease_seconds": 1.0})  # the leases D never touches end soon
    tokens = prompt(3 * BLOCK_SIZE + 1, salt=20)
    other = prompt(3 * BLOCK_SIZE + 1, salt=21)
    params = pd.prefill(tokens, "p-good")
    other_params = pd.prefill(other, "p-other")
    assert params is not None and other_params is not None
    unsigned = {k: v for k, v in params.items() if k != "signature"}
    far_blocks = [10_000 + b for b in params["remote_block_ids"]]
    bad = {
        "unsigned": unsigned,
        "forged": {**params, "remote_block_ids": other_params["remote_block_ids"]},
        "expired": _sign({**unsigned, "remote_lease_expiry_ms": int(time.time() * 1000) - 1}, tokens),
        "out_of_range": _sign({**unsigned, "remote_block_ids": far_blocks}, tokens),
        # correctly signed (the attacker knows the secret) but naming another request's blocks:
        # P's lease check refuses the pin.
        "other_lease": _sign({**unsigned, "remote_block_ids": other_params["remote_block_ids"]}, tokens),
        "other_prompt": other_params,
    }[tamper]
    with caplog.at_level(logging.WARNING):
        out = pd.decode({"x": (tokens, bad)}, max_tokens=4)["x"]
    assert out.outputs[0].token_ids == reference_tokens(reference, {"x": tokens}, 4)["x"]
    assert pd.d.get_stats()["kv_load_failures"] == 1
    assert pd.d.get_stats()["kv_transfer_bytes"] == 0  # nothing was read
    assert "recovering per kv_load_failure_policy" in caplog.text
    assert "different KV transfer secrets" not in caplog.text  # P and D share theirs: it is the params


def test_bad_params_with_policy_fail_end_the_request_with_an_error(make_pd, secret) -> None:
    pd = make_pd(d_policy="fail")
    tokens = prompt(2 * BLOCK_SIZE + 1, salt=22)
    params = pd.prefill(tokens, "p-f")
    assert params is not None
    forged = {**params, "remote_num_tokens": params["remote_num_tokens"], "remote_lease_id": "0-00"}
    out = pd.decode({"f": (tokens, forged)}, max_tokens=4)["f"]
    assert out.outputs[0].finish_reason == "error"
    assert out.error
    pd.decode({"ok": (tokens, params)}, max_tokens=2)  # the genuine params still work


def test_wrong_secret_on_d_recomputes(make_pd, reference, monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("KVRELAY_KV_SECRET", SECRET)
    wrong = tmp_path / "wrong"
    wrong.write_text("another-secret-0123456789\n")
    pd = make_pd(d_extra={"secret_file": str(wrong)}, p_extra={"lease_seconds": 1.0})
    tokens = prompt(2 * BLOCK_SIZE + 1, salt=23)
    params = pd.prefill(tokens, "p-ws")
    with caplog.at_level(logging.WARNING):
        out = pd.decode({"ws": (tokens, params)}, max_tokens=4)["ws"]
    assert out.outputs[0].token_ids == reference_tokens(reference, {"ws": tokens}, 4)["ws"]
    assert "P and D most likely hold different KV transfer secrets" in caplog.text


def test_fingerprint_mismatch_is_refused_with_a_clear_error(make_pd, reference, caplog) -> None:
    pd = make_pd(p_model={"num_hidden_layers": 3}, p_extra={"lease_seconds": 1.0})
    tokens = prompt(2 * BLOCK_SIZE + 1, salt=24)
    params = pd.prefill(tokens, "p-fp")
    with caplog.at_level(logging.WARNING):
        out = pd.decode({"fp": (tokens, params)}, max_tokens=4)["fp"]
    assert out.outputs[0].token_ids == reference_tokens(reference, {"fp": tokens}, 4)["fp"]
    assert "holds KV we cannot use (model differs: ours 'llama/L2/" in caplog.text
    assert "theirs 'llama/L3/" in caplog.text


def test_a_pin_for_byte_ranges_outside_ps_blocks_is_refused(make_pd) -> None:
    """A head-slice pin names (offset, length) ranges of P's blocks; P refuses ranges that leave
    a block before it checksums anything."""
    from kvrelay.kv_transfer.pull.meta import LEASE_REFUSED, LeaseStatus, PinRequest
    from kvrelay.kv_transfer.side_channel import decode

    pd = make_pd()
    tokens = prompt(2 * BLOCK_SIZE + 1, salt=25)
    params = pd.prefill(tokens, "p-ranges")
    assert params is not None
    pd.p.step()  # P registers the lease
    ctx = zmq.Context()
    client = SideChannelClient(ctx, "127.0.0.1", params["remote_port"], security.load_keys(None).channel)
    try:
        pin = PinRequest(request_id=params["remote_request_id"], lease_id=params["remote_lease_id"],
                         block_ids=params["remote_block_ids"], prompt_digest=security.prompt_digest(tokens),
                         want_checksums=True, ranges=[(0, 64), (10**9, 64)])
        status = decode(client.call("pin", pin, 5).body, LeaseStatus)
        assert status.state == LEASE_REFUSED and "fall outside a block" in status.error
    finally:
        client.close()
        ctx.term()
    pd.decode({"ranges": (tokens, params)}, max_tokens=2)  # the lease still serves D's own read

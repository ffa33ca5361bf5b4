"""NixlPushConnector with P and D in one process over the real TCP transport, watched by a spy:
writes leave as layers complete, a late registration gets what is done at once, and every
failure ends in a recompute (or an error, per policy) with nothing leaked on either side."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvrelay.attention import forward_context
from kvrelay.kv_transfer.p2p import security, settings
from kvrelay.kv_transfer.push.meta import PushLanded, PushNotification
from kvrelay.kv_transfer.transport import nixl_installed
from kvrelay.kv_transfer.transport.base import FinishedTransfer
from tests.kv_transfer.p2p.pd import BLOCK_SIZE, PD, free_port, greedy, kv_threads, make_engine, prompt
from tests.kv_transfer.push.test_push_processes import d_params, p_params, push_config

pytestmark = pytest.mark.timeout(180)
NUM_LAYERS = 2  # tests/tiny.py's model


@dataclass
class Write:
    engine_id: str
    layers: tuple[int, ...]
    num_blocks: int
    notified: bool
    in_forward: bool  # issued from inside the forward pass (save_kv_layer)
    landed: PushLanded | None = None  # an earlier write's notification (one-sided transports)
    notification_bytes: int = 0


class Spy:
    def __init__(self) -> None:
        self.writes: list[Write] = []
        self.fail_writes = False
        self.corrupt_checksums = False
        self.backend = "tcp"
        self.one_sided = False  # both TCP transports act as NIXL's: D does not see writes land
        self.drop_landed = 0  # send this many PushLanded notifications as nothing


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    spy = Spy()
    real = settings.make_transport

    def create(config: Any, transfer_config: Any, secret: bytes | None) -> Any:
        transport = real(dataclasses.replace(config, backend=spy.backend), transfer_config, secret)
        if spy.backend == "tcp":
            transport.sees_writes = not spy.one_sided
        write = transport.write_blocks

        def spied(remote: str, local: list[int], remote_ids: list[int], notification: bytes,
                  layers: Any = None, ranges: Any = None) -> Any:
            in_forward = forward_context._forward_context is not None
            landed = PushLanded.decode(notification)
            if landed is not None and spy.drop_landed:
                spy.drop_landed -= 1
                notification = b""
            note = PushNotification.decode(notification)
            spy.writes.append(Write(transfer_config.engine_id, tuple(layers or ()), len(local),
                                    note is not None, in_forward, landed, len(notification)))
            if spy.fail_writes:
                return FinishedTransfer("injected write failure")
            if spy.corrupt_checksums and note is not None and note.checksums:
                note.checksums[0] += 1
                notification = note.encode()
            return write(remote, local, remote_ids, notification, layers, ranges=ranges)

        transport.write_blocks = spied  # type: ignore[method-assign]
        return transport

    monkeypatch.setattr(settings, "make_transport", create)
    return spy


@pytest.fixture
def make_pair(spy: Spy) -> Iterator[Callable[..., tuple[PD, int]]]:
    pairs: list[PD] = []

    def build(p_batch: int = 256, d_policy: str = "recompute", p_extra: dict[str, Any] | None = None,
              d_extra: dict[str, Any] | None = None,
              p_engine: dict[str, Any] | None = None) -> tuple[PD, int]:
        port = free_port()
        p = make_engine(push_config("kv_producer", spy.backend, port=port, **(p_extra or {})),
                        max_num_batched_tokens=p_batch, **(p_engine or {}))
        d = make_engine(push_config("kv_consumer", spy.backend, policy=d_policy, **(d_extra or {})))
        pairs.append(PD(p, d))
        return pairs[-1], port

    yield build
    try:
        for pair in pairs:
            pair.settle()
            assert pair.p.blocks_in_use == 0, f"P leaked {pair.p.blocks_in_use} blocks"
            assert pair.d.blocks_in_use == 0, f"D leaked {pair.d.blocks_in_use} blocks"
    finally:
        for pair in pairs:
            pair.close()
    assert not kv_threads(), f"threads left behind: {kv_threads()}"


@pytest.fixture(scope="module")
def reference() -> Any:
    return make_engine(None)


def ref_tokens(reference: Any, tokens: list[int], max_tokens: int) -> list[int]:
    from tests.kv_transfer.p2p.pd import reference_tokens

    return reference_tokens(reference, {"r": tokens}, max_tokens)["r"]


def _registered(pair: PD, transfer_id: str) -> bool:
    sender = pair.p.runner.connector.worker.sender
    return transfer_id in sender._waiting or transfer_id in sender._jobs  # registered, or declined


def push(pair: PD, port: int, rid: str, tokens: list[int], max_tokens: int = 4, p_first: bool = False) -> Any:
    """Both legs; by default D registers first (the proxy's order). Returns D's output."""
    def add_p() -> None:
        pair.p.add_request({"prompt_token_ids": tokens}, greedy(1), request_id=f"p-{rid}",
                           kv_transfer_params=p_params(f"t-{rid}"))

    if p_first:
        add_p()
        pair.wait(pair.p, {f"p-{rid}"})
    pair.d.add_request({"prompt_token_ids": tokens}, greedy(max_tokens), request_id=rid,
                       kv_transfer_params=d_params(f"t-{rid}", port))
    if not p_first:  # D admits and registers before P sees the request (the proxy's aim)
        pair.settle(until=lambda: _registered(pair, f"t-{rid}"), timeout_s=10)
        add_p()
    return pair.wait(pair.d, {rid})[rid]


def test_each_layer_is_written_from_inside_the_forward_as_it_completes(make_pair, spy, reference) -> None:
    pair, port = make_pair()
    tokens = prompt(3 * BLOCK_SIZE + 1, 60)
    out = push(pair, port, "a", tokens)
    assert out.outputs[0].token_ids == ref_tokens(reference, tokens, 4)
    writes = [w for w in spy.writes if w.num_blocks]
    assert [w.layers for w in writes] == [(layer,) for layer in range(NUM_LAYERS)]
    assert all(w.in_forward for w in writes)
    assert [w.notified for w in writes] == [False] * (NUM_LAYERS - 1) + [True]


def test_chunked_prefill_pushes_each_chunk_layer_by_layer(make_pair, spy, reference) -> None:
    pair, port = make_pair(p_batch=16)  # 41 tokens: chunks of 16, 16 and 9
    tokens = prompt(10 * BLOCK_SIZE + 1, 61)
    out = push(pair, port, "c", tokens)
    assert out.outputs[0].token_ids == ref_tokens(reference, tokens, 4)
    writes = [w for w in spy.writes if w.num_blocks]
    assert [w.layers for w in writes] == [(layer,) for _ in range(3) for layer in range(NUM_LAYERS)]
    assert sum(w.notified for w in writes) == 1 and writes[-1].notified
    assert pair.d.get_stats()["prompt_tokens_computed"] == 1


def _no_full_recount(*args: Any) -> list[int]:
    raise AssertionError("block_digests over all layers ran at the completing write")


# (backend, one-sided): TCP as it is (D sees each write land), TCP acting one-sided, real NIXL
ONE_SIDED = [pytest.param(("tcp", False), id="tcp-sees-writes"),
             pytest.param(("tcp", True), id="tcp-as-one-sided"),
             pytest.param(("nixl", True), id="nixl",
                          marks=pytest.mark.skipif(not nixl_installed(), reason="no nixl transport"))]


@pytest.mark.parametrize("one_sided", ONE_SIDED)
def test_checksums_taken_before_the_last_write_agree_across_unaligned_chunks_and_a_p_prefix_hit(
        make_pair, spy, reference, monkeypatch, one_sided) -> None:
    """P folds each layer's final blocks into its checksums during the forward (a chunk's partial
    last block only once the prompt is complete); D sums every write as it lands (TCP: it sees
    each write land; one-sided: each write's notification says what landed). Neither recounts
    all the KV at the end, and they agree on every block."""
    monkeypatch.setattr(security, "block_digests", _no_full_recount)
    spy.backend, spy.one_sided = one_sided
    pair, port = make_pair(p_batch=18)  # chunks end inside blocks
    first = prompt(9 * BLOCK_SIZE + 3, 63)
    second = [*first[:6 * BLOCK_SIZE], *prompt(3 * BLOCK_SIZE + 1, 64)]  # P's prefix cache hit
    for rid, tokens in (("f1", first), ("f2", second)):
        out = push(pair, port, rid, tokens)
        assert out.outputs[0].token_ids == ref_tokens(reference, tokens, 4)
    stats = pair.d.get_stats()
    assert stats["prompt_tokens_computed"] == 2 and stats["kv_load_failures"] == 0


def test_late_registration_gets_every_computed_layer_at_once(make_pair, spy, reference) -> None:
    pair, port = make_pair()
    tokens = prompt(4 * BLOCK_SIZE + 2, 62)
    out = push(pair, port, "late", tokens, p_first=True)
    assert out.outputs[0].token_ids == ref_tokens(reference, tokens, 4)
    writes = [w for w in spy.writes if w.num_blocks]
    assert len(writes) == 1 and writes[0].layers == tuple(range(NUM_LAYERS)) and writes[0].notified


def test_d_aborted_while_waiting_frees_both_sides_and_p_writes_nothing(make_pair, spy) -> None:
    pair, port = make_pair()
    tokens = prompt(3 * BLOCK_SIZE, 63)
    pair.d.add_request({"prompt_token_ids": tokens}, greedy(4), request_id="gone",
                       kv_transfer_params=d_params("t-gone", port))
    pair.settle(until=lambda: pair.d.get_stats()["num_waiting_for_remote_kv"] == 1, timeout_s=10)
    pair.d.abort_request("gone")
    pair.settle(until=lambda: pair.d.blocks_in_use == 0, timeout_s=10)
    pair.p.add_request({"prompt_token_ids": tokens}, greedy(1), request_id="p-gone",
                       kv_transfer_params=p_params("t-gone"))
    pair.wait(pair.p, {"p-gone"})
    assert [w for w in spy.writes if w.num_blocks] == []


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_write_ends_in_the_failure_policy(make_pair, spy, reference, policy) -> None:
    pair, port = make_pair(d_policy=policy, d_extra={"heartbeat_seconds": 0.1})
    spy.fail_writes = True
    tokens = prompt(3 * BLOCK_SIZE + 1, 64)
    out = push(pair, port, "w", tokens)
    if policy == "recompute":
        assert out.outputs[0].token_ids == ref_tokens(reference, tokens, 4)
    else:
        assert out.outputs[0].finish_reason == "error"
    assert pair.d.get_stats()["kv_load_failures"] == 1


def test_one_sided_writes_each_say_what_landed_in_a_small_notification(make_pair, spy, reference) -> None:
    spy.one_sided = True
    pair, port = make_pair(p_batch=16)  # 41 tokens: chunks of 16, 16 and 9
    tokens = prompt(10 * BLOCK_SIZE + 1, 71)
    out = push(pair, port, "o", tokens)
    assert out.outputs[0].token_ids == ref_tokens(reference, tokens, 4)
    writes = [w for w in spy.writes if w.num_blocks]
    assert [w.layers for w in writes] == [(layer,) for _ in range(3) for layer in range(NUM_LAYERS)]
    earlier, last = writes[:-1], writes[-1]
    assert last.notified and last.landed is None and not any(w.notified for w in earlier)
    ranges = [(w.landed.layers, w.landed.start, w.landed.end) for w in earlier if w.landed is not None]
    assert ranges == [([0], 0, 4), ([1], 0, 4), ([0], 4, 8), ([1], 4, 8), ([0], 8, 11)]
    assert max(w.notification_bytes for w in earlier) < 100


def test_tcp_writes_carry_no_landed_notification(make_pair, spy, reference) -> None:
    pair, port = make_pair(p_batch=16)
    out = push(pair, port, "t", prompt(10 * BLOCK_SIZE + 1, 72))
    assert out.outputs[0].finish_reason is not None
    assert [w for w in spy.writes if w.landed is not None or (w.notification_bytes and not w.notified)] == []


def test_a_lost_landed_notification_falls_back_to_counting_every_block(make_pair, spy, reference,
                                                                        monkeypatch) -> None:
    calls: list[int] = []
    real = security.block_digests

    def counted(*args: Any) -> list[int]:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(security, "block_digests", counted)
    spy.one_sided, spy.drop_landed = True, 1
    pair, port = make_pair(p_batch=16)
    tokens = prompt(10 * BLOCK_SIZE + 1, 73)
    out = push(pair, port, "lost", tokens)
    assert out.outputs[0].token_ids == ref_tokens(reference, tokens, 4)
    assert calls == [1]
    stats = pair.d.get_stats()
    assert stats["kv_load_failures"] == 0 and stats["prompt_tokens_computed"] == 1


def test_landed_notifications_for_a_receive_that_ended_are_ignored(make_pair, spy, reference) -> None:
    spy.one_sided = True
    pair, port = make_pair(p_batch=16)
    push(pair, port, "ended", prompt(10 * BLOCK_SIZE + 1, 74))
    receiver = pair.d.runner.connector.worker.receiver
    stale = [w.landed for w in spy.writes if w.landed is not None]
    assert stale
    for landed in stale:  # delivered again, after the receive finished
        receiver._on_notification(landed.encode())
    results = receiver.poll()
    assert not results.finished and not results.failed and not results.stats


@pytest.mark.parametrize("one_sided", ONE_SIDED)
def test_a_checksum_mismatch_is_recomputed(make_pair, spy, reference, monkeypatch, one_sided) -> None:
    monkeypatch.setattr(security, "block_digests", _no_full_recount)  # caught by the landed sums
    spy.backend, spy.one_sided = one_sided
    pair, port = make_pair(p_batch=16)
    spy.corrupt_checksums = True
    tokens = prompt(10 * BLOCK_SIZE + 1, 65)
    out = push(pair, port, "x", tokens)
    assert out.outputs[0].token_ids == ref_tokens(reference, tokens, 4)
    stats = pair.d.get_stats()
    assert stats["kv_load_failures"] == 1 and stats["prompt_tokens_computed"] > 1


def test_p_frees_an_unregistered_push_when_its_lease_expires(make_pair) -> None:
    pair, _ = make_pair(p_extra={"lease_seconds": 0.3})
    pair.p.add_request({"prompt_token_ids": prompt(9, 66)}, greedy(1), request_id="p-alone",
                       kv_transfer_params=p_params("t-alone"))
    pair.wait(pair.p, {"p-alone"})
    assert pair.p.blocks_in_use > 0  # held for a registration
    deadline = time.monotonic() + 10
    while pair.p.blocks_in_use and time.monotonic() < deadline:
        pair.step()
        time.sleep(0.01)
    assert pair.p.blocks_in_use == 0 and pair.p.get_stats()["kv_lease_expired"] == 1


def test_a_registration_p_never_starts_fails_naming_the_likely_cause(make_pair, reference, caplog) -> None:
    pair, port = make_pair(d_extra={"transfer_timeout_seconds": 0.5, "heartbeat_seconds": 0.1})
    tokens = prompt(2 * BLOCK_SIZE + 1, 70)
    pair.d.add_request({"prompt_token_ids": tokens}, greedy(3), request_id="orphan",
                       kv_transfer_params=d_params("t-orphan", port))  # no prefill leg reaches P
    out = pair.wait(pair.d, {"orphan"})["orphan"]
    assert out.outputs[0].token_ids == ref_tokens(reference, tokens, 3)
    (failure,) = [m for m in caplog.messages if "recovering per kv_load_failure_policy" in m]
    assert "saw no progress from P rank 0" in failure and "P never started this request" in failure
    assert "a proxy in pull mode (the default) fronts these NixlPushConnector instances" in failure
    assert "--transfer-mode push --prefill-kv HOST:PORT" in failure


def test_a_registration_for_another_prompt_is_refused(make_pair, reference) -> None:
    pair, port = make_pair(d_extra={"heartbeat_seconds": 0.1})
    tokens, other = prompt(2 * BLOCK_SIZE + 1, 67), prompt(2 * BLOCK_SIZE + 1, 68)
    pair.p.add_request({"prompt_token_ids": other}, greedy(1), request_id="p-m",
                       kv_transfer_params=p_params("t-m"))
    pair.wait(pair.p, {"p-m"})
    pair.d.add_request({"prompt_token_ids": tokens}, greedy(3), request_id="m",
                       kv_transfer_params=d_params("t-m", port))
    out = pair.wait(pair.d, {"m"})["m"]
    assert out.outputs[0].token_ids == ref_tokens(reference, tokens, 3)
    assert pair.d.get_stats()["kv_load_failures"] == 1


def test_a_p_in_the_batch_invariant_mode_and_a_d_without_refuse_each_other_and_d_recomputes(
        make_pair, spy, reference) -> None:
    pair, port = make_pair(p_extra={"lease_seconds": 1.0}, p_engine={"batch_invariant": True})
    tokens = prompt(3 * BLOCK_SIZE + 1, 70)
    out = push(pair, port, "bi", tokens, p_first=True)
    assert out.outputs[0].token_ids == ref_tokens(reference, tokens, 4)
    stats = pair.d.get_stats()
    assert (stats["kv_transfer_incompatible"], stats["kv_load_failures"]) == (1, 1)
    assert stats["prompt_tokens_computed"] == len(tokens) and not [w for w in spy.writes if w.num_blocks]


def test_push_after_prefill_writes_the_whole_prompt_once(make_pair, spy, reference) -> None:
    pair, port = make_pair(p_batch=16, p_extra={"layerwise": False})  # vLLM's design, chunked P
    tokens = prompt(10 * BLOCK_SIZE + 1, 69)
    out = push(pair, port, "after", tokens)
    assert out.outputs[0].token_ids == ref_tokens(reference, tokens, 4)
    writes = [w for w in spy.writes if w.num_blocks]
    assert len(writes) == 1 and writes[0].layers == tuple(range(NUM_LAYERS)) and writes[0].notified
    assert writes[0].num_blocks == 11


def test_bad_push_settings_are_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match="layerwise must be true or false"):
        make_engine(push_config("kv_producer", "tcp", layerwise="yes"))
    with pytest.raises(ValueError, match="unknown .* key"):
        make_engine(push_config("kv_producer", "tcp", layer_wise=True))


def test_a_full_local_hit_on_d_lets_p_free_at_once(make_pair, spy, reference) -> None:
    pair, port = make_pair()
    base = prompt(3 * BLOCK_SIZE, 70)
    push(pair, port, "warm", base + [3, 4])  # D's cache now holds base's 3 blocks
    full = base + [5]
    out = push(pair, port, "full", full)
    assert out.outputs[0].token_ids == ref_tokens(reference, full, 4)
    pair.settle(timeout_s=3)  # well before the registration lease (3 heartbeats, 6 s) would end it
    assert pair.p.blocks_in_use == 0
    assert pair.d.get_stats()["kv_load_failures"] == 0

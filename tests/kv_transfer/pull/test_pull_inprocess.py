"""NixlConnector end to end: P and D engines in one process, an in-process transport, the real
side channel on loopback. Every test ends with zero blocks in use on both and no thread left
(checked by the make_pd fixture)."""

from __future__ import annotations

import pytest

from tests.kv_transfer.p2p.pd import BLOCK_SIZE, greedy, make_engine, prompt, reference_tokens, shutdown


def _lease_expired(engine) -> int:  # type: ignore[no-untyped-def]
    return int(engine.get_stats()["kv_lease_expired"])


def _transferred_tokens(engine) -> int:  # type: ignore[no-untyped-def]
    return int(engine.get_stats()["prompt_tokens_external"])


def test_decode_reproduces_single_instance_for_short_exact_and_partial_prompts(make_pd, reference) -> None:
    pd = make_pd()
    prompts = {"short": prompt(BLOCK_SIZE - 1), "exact": prompt(2 * BLOCK_SIZE, 1),
               "partial": prompt(2 * BLOCK_SIZE + 3, 2)}
    got = pd.run(prompts, max_tokens=6)
    assert got == reference_tokens(reference, prompts, 6)
    # D computed only the last prompt token of each: everything else came from P.
    assert pd.d.get_stats()["prompt_tokens_computed"] == len(prompts)
    pd.settle()
    assert _lease_expired(pd.p) == 0


def test_many_concurrent_requests(make_pd, reference) -> None:
    pd = make_pd()
    prompts = {f"r{i}": prompt(2 + 3 * i, salt=i) for i in range(10)}
    assert pd.run(prompts, max_tokens=4) == reference_tokens(reference, prompts, 4)


def test_full_local_prefix_hit_reads_nothing_and_p_frees_at_once(make_pd, reference) -> None:
    pd = make_pd()
    tokens = prompt(2 * BLOCK_SIZE + 1, salt=5)  # two full blocks + the last token
    pd.decode({"warm": (tokens, None)}, max_tokens=2)  # D's prefix cache now holds both blocks
    before = _transferred_tokens(pd.d)
    params = pd.prefill(tokens, "p-hit")
    out = pd.decode({"hit": (tokens, params)}, max_tokens=5)["hit"]
    assert out.outputs[0].token_ids == reference_tokens(reference, {"hit": tokens}, 5)["hit"]
    assert _transferred_tokens(pd.d) == before
    pd.settle(timeout_s=10)  # far less than the 30 s lease: the release freed P's blocks
    assert _lease_expired(pd.p) == 0


def test_partial_local_prefix_hit_pairs_new_blocks_with_the_last_remote_blocks(make_pd, reference) -> None:
    pd = make_pd()
    tokens = prompt(3 * BLOCK_SIZE + 2, salt=6)
    pd.decode({"warm": (tokens[:BLOCK_SIZE + 1], None)}, max_tokens=1)  # D caches block 0 only
    params = pd.prefill(tokens, "p-part")
    out = pd.decode({"part": (tokens, params)}, max_tokens=5)["part"]
    assert out.outputs[0].token_ids == reference_tokens(reference, {"part": tokens}, 5)["part"]
    assert pd.d.get_stats()["prompt_tokens_cached"] == BLOCK_SIZE  # D's local hit
    # The usage reports P's own hit (vLLM's remote_prefill_cached_tokens): P computed it all.
    assert out.num_cached_tokens == params["remote_prefill_cached_tokens"] == 0
    assert pd.d.get_stats()["kv_transfer_bytes"] > 0


def test_d_reports_ps_own_prefix_hit_as_its_cached_tokens(make_pd, reference) -> None:
    pd = make_pd()
    tokens = prompt(3 * BLOCK_SIZE + 2, salt=9)
    pd.p.add_request({"prompt_token_ids": tokens[:2 * BLOCK_SIZE + 1]}, greedy(1), request_id="warm")
    pd.wait(pd.p, {"warm"})  # P's prefix cache now holds blocks 0-1
    params = pd.prefill(tokens, "p-warm")
    assert params is not None and params["remote_prefill_cached_tokens"] == 2 * BLOCK_SIZE
    out = pd.decode({"warm-d": (tokens, params)}, max_tokens=3)["warm-d"]
    assert out.outputs[0].token_ids == reference_tokens(reference, {"warm-d": tokens}, 3)["warm-d"]
    assert out.num_cached_tokens == 2 * BLOCK_SIZE  # as vLLM reports it: not the KV D loaded


def test_abort_before_admission_releases_p_blocks(make_pd) -> None:
    pd = make_pd()
    tokens = prompt(2 * BLOCK_SIZE + 1, salt=7)
    params = pd.prefill(tokens, "p-early")
    pd.d.add_request({"prompt_token_ids": tokens}, greedy(3), request_id="early", kv_transfer_params=params)
    pd.d.abort_request("early")  # never scheduled
    pd.settle(timeout_s=10)
    assert _lease_expired(pd.p) == 0


def test_a_request_d_refuses_before_queueing_still_releases_p_blocks(make_pd) -> None:
    pd = make_pd()
    tokens = prompt(2 * BLOCK_SIZE + 1, salt=10)
    params = pd.prefill(tokens, "p-refused")
    assert params is not None and pd.p.blocks_in_use > 0
    pd.d.release_remote_kv(tokens, params)  # what `kvrelay serve` does when it refuses the request
    pd.settle(timeout_s=10)  # far less than the 30 s lease
    assert pd.p.blocks_in_use == 0 and _lease_expired(pd.p) == 0
    assert pd.d.blocks_in_use == 0 and not pd.d.scheduler.requests


def test_abort_while_handshaking_releases_p_blocks(make_pd) -> None:
    pd = make_pd()
    tokens = prompt(2 * BLOCK_SIZE + 1, salt=8)
    params = pd.prefill(tokens, "p-hs")
    pd.d.add_request({"prompt_token_ids": tokens}, greedy(3), request_id="hs", kv_transfer_params=params)
    pd.d.step()  # admitted: WAITING_FOR_REMOTE_KVS, the pull is with the worker
    assert pd.d.get_stats()["num_waiting_for_remote_kv"] == 1
    pd.d.abort_request("hs")
    pd.settle(timeout_s=10)
    assert _lease_expired(pd.p) == 0


def test_abort_during_the_read_frees_d_blocks_only_after_it_settled(make_pd, transports) -> None:
    pd = make_pd()
    transports[1].read_delay_s = 0.5
    tokens = prompt(3 * BLOCK_SIZE, salt=9)
    params = pd.prefill(tokens, "p-read")
    pd.d.add_request({"prompt_token_ids": tokens}, greedy(3), request_id="read", kv_transfer_params=params)
    pd.settle(until=lambda: transports[1].reads_started == 1, timeout_s=10)
    pd.d.abort_request("read")
    pd.d.step()
    assert pd.d.blocks_in_use > 0  # NOTE: the read may still land: the blocks wait for it
    pd.settle(timeout_s=10)
    assert transports[1].reads_cancelled == 0
    assert _lease_expired(pd.p) == 0


def test_unread_lease_expires_and_a_late_decode_recomputes(make_pd, reference) -> None:
    pd = make_pd(p_extra={"lease_seconds": 0.5})
    tokens = prompt(2 * BLOCK_SIZE + 2, salt=10)
    params = pd.prefill(tokens, "p-late")
    pd.settle(until=lambda: _lease_expired(pd.p) == 1, timeout_s=10)
    assert pd.p.blocks_in_use == 0
    out = pd.decode({"late": (tokens, params)}, max_tokens=4)["late"]
    assert out.outputs[0].token_ids == reference_tokens(reference, {"late": tokens}, 4)["late"]
    assert pd.d.get_stats()["kv_load_failures"] == 1


def test_replayed_params_after_p_freed_fail_cleanly(make_pd, reference) -> None:
    pd = make_pd()
    tokens = prompt(3 * BLOCK_SIZE + 1, salt=11)
    params = pd.prefill(tokens, "p-once")
    pd.decode({"first": (tokens, params)}, max_tokens=2)
    pd.settle()
    assert pd.d.scheduler.reset_prefix_cache()  # so the replay has to read again
    out = pd.decode({"again": (tokens, params)}, max_tokens=4)["again"]
    assert out.outputs[0].token_ids == reference_tokens(reference, {"again": tokens}, 4)["again"]
    assert pd.d.get_stats()["kv_load_failures"] == 1


def test_heartbeats_keep_a_slow_read_alive_past_the_lease(make_pd, transports, reference) -> None:
    pd = make_pd(p_extra={"lease_seconds": 1.0}, d_extra={"heartbeat_seconds": 0.1})
    transports[1].read_delay_s = 2.0
    tokens = prompt(2 * BLOCK_SIZE + 1, salt=12)
    params = pd.prefill(tokens, "p-slow")
    out = pd.decode({"slow": (tokens, params)}, max_tokens=4)["slow"]
    assert out.outputs[0].token_ids == reference_tokens(reference, {"slow": tokens}, 4)["slow"]
    assert pd.d.get_stats()["kv_load_failures"] == 0
    pd.settle()
    assert _lease_expired(pd.p) == 0


def test_unanswered_heartbeats_cancel_the_read_before_the_lease_can_lapse(make_pd, transports,
                                                                          reference) -> None:
    pd = make_pd(p_extra={"lease_seconds": 1.0},
                 d_extra={"heartbeat_seconds": 0.1, "transfer_timeout_seconds": 120.0})
    # The read would take 60 s and D's transfer timeout is 120 s: a read cancelled within the 30 s
    # wait can only be the unanswered heartbeats' doing (no wall-clock bound asserted).
    transports[1].read_delay_s = 60.0
    tokens = prompt(2 * BLOCK_SIZE + 1, salt=13)
    params = pd.prefill(tokens, "p-mute")
    pd.d.add_request({"prompt_token_ids": tokens}, greedy(4), request_id="mute", kv_transfer_params=params)
    pd.settle(until=lambda: transports[1].reads_started == 1, timeout_s=10)
    pd.p.runner.connector.worker.server.close()  # P's side channel goes silent
    pd.p.runner.connector.worker.server = None
    out = pd.wait(pd.d, {"mute"}, timeout_s=30)["mute"]
    assert transports[1].reads_cancelled == 1  # given up before the read could have ended
    assert out.outputs[0].token_ids == reference_tokens(reference, {"mute": tokens}, 4)["mute"]
    pd.settle()
    assert _lease_expired(pd.p) == 1


def test_transfer_timeout_fails_the_pull_and_recomputes(make_pd, transports, reference) -> None:
    pd = make_pd(d_extra={"transfer_timeout_seconds": 0.5})
    transports[1].read_delay_s = 5.0
    tokens = prompt(2 * BLOCK_SIZE, salt=14)
    params = pd.prefill(tokens, "p-to")
    out = pd.decode({"to": (tokens, params)}, max_tokens=3)["to"]
    assert out.outputs[0].token_ids == reference_tokens(reference, {"to": tokens}, 3)["to"]
    assert transports[1].reads_cancelled == 1
    assert pd.d.get_stats()["kv_load_failures"] == 1


def test_transfer_error_recomputes(make_pd, transports, reference) -> None:
    pd = make_pd()
    transports[1].fail_reads = True
    tokens = prompt(2 * BLOCK_SIZE + 1, salt=15)
    params = pd.prefill(tokens, "p-err")
    out = pd.decode({"err": (tokens, params)}, max_tokens=3)["err"]
    assert out.outputs[0].token_ids == reference_tokens(reference, {"err": tokens}, 3)["err"]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_corrupted_block_is_caught_by_the_checksum(make_pd, transports, reference, policy) -> None:
    pd = make_pd(d_policy=policy)
    transports[1].corrupt_reads = True
    tokens = prompt(3 * BLOCK_SIZE + 1, salt=16)
    params = pd.prefill(tokens, "p-bad")
    out = pd.decode({"bad": (tokens, params)}, max_tokens=3)["bad"]
    if policy == "recompute":
        assert out.outputs[0].token_ids == reference_tokens(reference, {"bad": tokens}, 3)["bad"]
    else:
        assert out.outputs[0].finish_reason == "error"
    assert pd.d.get_stats()["kv_load_failures"] == 1


def test_restarted_p_is_handshaken_again_and_its_old_params_fail_cleanly(make_pd, reference) -> None:
    pd = make_pd()
    old_tokens, new_tokens = prompt(2 * BLOCK_SIZE + 1, salt=17), prompt(2 * BLOCK_SIZE + 2, salt=18)
    pd.decode({"before": (old_tokens, pd.prefill(old_tokens, "p-0"))}, max_tokens=2)  # D knows P now
    stale = pd.prefill(old_tokens, "p-1")
    config = pd.p.config.kv_transfer
    shutdown(pd.p)  # P restarts: same engine id and port, new process state
    pd.p = make_engine({"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_ip": "127.0.0.1",
                        "kv_port": config.kv_port, "engine_id": config.engine_id})
    fresh = pd.prefill(new_tokens, "p-1")  # the same request id as the stale lease
    assert pd.d.scheduler.reset_prefix_cache()
    outs = pd.decode({"stale": (old_tokens, stale), "fresh": (new_tokens, fresh)}, max_tokens=4)
    want = reference_tokens(reference, {"stale": old_tokens, "fresh": new_tokens}, 4)
    assert {rid: out.outputs[0].token_ids for rid, out in outs.items()} == want
    assert pd.d.get_stats()["kv_load_failures"] == 1  # the stale one; the fresh one was read
    assert pd.d.get_stats()["prompt_tokens_external"] >= len(new_tokens) - 1

"""The scheduler with a KV connector (FakeConnector + FakeRunner): remote prefill on the decode
side, delayed freeing on the prefill side, loads that wait for blocks, preemption and aborts.
Every test ends with no block in use."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay.request import RequestStatus
from tests.core.connector_harness import (
    P2P_PARAMS,
    calls,
    finish,
    new_req_data,
    num_hit_tokens,
    prompt,
    setup,
    step,
)
from tests.helpers import expected_tokens, make_request

# ------------------------------------------------------------------ decode side: async load


def test_async_load_runs_nothing_and_holds_unpublished_blocks():
    sched, conn, runner = setup()
    p = prompt(10, 100)
    a = make_request(p, request_id="a", max_tokens=3)
    conn.set_external_tokens(10, load_async=True, request_id="a")
    sched.add_request(a)
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {} and outs == []
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert sched.num_waiting_for_remote_kv == 1 and sched.num_running == 0
    held = sched.kv_cache_manager.get_block_ids("a")
    assert len(held) == 3 and sched.blocks_in_use == 3
    assert calls(conn, "update_state_after_alloc", "a") == [("update_state_after_alloc", "a", held, 10)]
    # The blocks are still being written: an identical prompt arriving now must not hit them.
    assert num_hit_tokens(sched, p) == 0
    twin = make_request(p, request_id="twin", max_tokens=3)
    sched.add_request(twin)
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"twin": 10} and twin.num_cached_tokens == 0
    step(sched, runner, finished_recving={"a"})
    finish(sched, runner)
    assert a.output_token_ids == twin.output_token_ids == expected_tokens(p, 3)


def test_request_waiting_for_remote_kv_keeps_its_queue_position():
    sched, conn, runner = setup(max_num_seqs=2)
    a = make_request(prompt(10, 100), request_id="a", max_tokens=2)
    b = make_request(prompt(5, 200), request_id="b", max_tokens=3)
    c = make_request(prompt(5, 300), request_id="c", max_tokens=10)
    conn.set_external_tokens(10, load_async=True, request_id="a")
    for req in (a, b, c):
        sched.add_request(req)
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"b": 5, "c": 5}  # local requests run while "a" loads
    late = make_request(prompt(5, 400), request_id="late", max_tokens=1)
    sched.add_request(late)
    so, _ = step(sched, runner, finished_recving={"a"})
    assert so.num_scheduled_tokens == {"b": 1, "c": 1}  # no free sequence slot yet
    so, _ = step(sched, runner)
    assert b.is_finished
    so, _ = step(sched, runner)
    # One slot freed: "a" arrived before "late" and takes it, with its single remaining token.
    assert so.num_scheduled_tokens == {"c": 1, "a": 1}
    assert late.status == RequestStatus.WAITING
    finish(sched, runner)
    for req in (a, b, c, late):
        assert req.output_token_ids == expected_tokens(req.prompt_token_ids, req.sampling_params.max_tokens)


@pytest.mark.parametrize("prompt_len, num_blocks, num_published", [
    (10, 3, 8),  # a partial last block: only the full ones are published
    (12, 3, 12),  # exactly three full blocks: all published, the last token computed again
    (3, 1, 0),  # shorter than one block: nothing to publish
])
def test_received_kv_is_published_and_exactly_one_token_is_computed(prompt_len, num_blocks, num_published):
    sched, conn, runner = setup()
    p = prompt(prompt_len, 100)
    a = make_request(p, request_id="a", max_tokens=4)
    conn.set_external_tokens(prompt_len, load_async=True, request_id="a")
    sched.add_request(a)
    step(sched, runner)
    step(sched, runner)  # still loading: nothing runs
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step(sched, runner, finished_recving={"a"})
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1}
    sent = new_req_data(so, "a")
    assert sent.num_computed_tokens == prompt_len - 1
    assert sent.block_ids == sched.kv_cache_manager.get_block_ids("a") and len(sent.block_ids) == num_blocks
    assert [o.new_token_ids for o in outs] == [expected_tokens(p, 1)]
    # The received full blocks serve a longer prompt that extends this one.
    assert num_hit_tokens(sched, p + [999]) == num_published
    assert len(calls(conn, "update_state_after_alloc", "a")) == 1
    finish(sched, runner)
    assert a.output_token_ids == expected_tokens(p, 4)


def test_async_load_on_top_of_a_local_prefix_hit():
    sched, conn, runner = setup()
    base = prompt(8, 100)
    sched.add_request(make_request(base + [7], request_id="first", max_tokens=1))
    finish(sched, runner)
    p = base + prompt(6, 500)
    a = make_request(p, request_id="a", max_tokens=3)
    conn.set_external_tokens(14, load_async=True, request_id="a")
    sched.add_request(a)
    step(sched, runner)
    held = sched.kv_cache_manager.get_block_ids("a")
    assert calls(conn, "update_state_after_alloc", "a") == [("update_state_after_alloc", "a", held, 6)]
    # The local hit, and vLLM's count of cached tokens: that hit plus what the connector offered.
    assert (a.num_local_cached_tokens, a.num_cached_tokens) == (8, 14)
    step(sched, runner, finished_recving={"a"})
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1}
    finish(sched, runner)
    assert a.output_token_ids == expected_tokens(p, 3)


def test_cached_tokens_count_the_local_hit_and_the_load_or_ps_hit_when_p_says_it():
    """vLLM's usage.prompt_tokens_details.cached_tokens: the local hit plus what the connector
    offered at the first admission; on D of a P/D pair, P's own hit when P's params carry it."""
    sched, conn, runner = setup()
    base = prompt(8, 100)
    sched.add_request(make_request(base + [7], request_id="first", max_tokens=1))
    finish(sched, runner)
    p = base + prompt(6, 500)
    params: dict[str, Any] = {"sync": None, "async": P2P_PARAMS,
                              "pd": {**P2P_PARAMS, "remote_prefill_cached_tokens": 3}}
    loads = {name: (make_request(p, request_id=name, max_tokens=1, kv_transfer_params=params[name]),
                    name != "sync") for name in params}
    outputs = {}
    for name, (req, load_async) in loads.items():
        conn.set_external_tokens(14, load_async=load_async, request_id=name)
        sched.add_request(req)
        settled = {"finished_recving": {name}} if load_async else {}
        outs = step(sched, runner)[1] + step(sched, runner, **settled)[1]
        while not req.is_finished:
            outs += step(sched, runner)[1]
        outputs.update({o.request_id: o for o in outs})
        finish(sched, runner)
    # A synchronous load leaves the last token to compute; an asynchronous one claims it too.
    assert {name: o.num_cached_tokens for name, o in outputs.items()} == {"sync": 13, "async": 14, "pd": 3}
    # The later two hit the blocks "sync" computed locally; the sums are the same.
    assert [req.num_local_cached_tokens for req, _ in loads.values()] == [8, 12, 12]


# ------------------------------------------------------------------ prefill side: delayed free


def test_prefill_side_keeps_blocks_until_finished_sending():
    sched, conn, runner = setup()
    conn.delay_free = ["p"]
    conn.params_by_request["p"] = P2P_PARAMS
    p = prompt(10, 100)
    req = make_request(p, request_id="p", max_tokens=1)
    sched.add_request(req)
    _, outs = step(sched, runner)
    assert [(o.request_id, o.finish_reason) for o in outs] == [("p", "length")]
    assert outs[0].new_token_ids == expected_tokens(p, 1)
    # vLLM's field: P's own cache hit on the prompt, for D to report in its usage.
    assert outs[0].kv_transfer_params == {**P2P_PARAMS, "remote_prefill_cached_tokens": 0}
    held = sched.kv_cache_manager.get_block_ids("p")
    assert calls(conn, "request_finished", "p") == [("request_finished", "p", held)]
    for _ in range(3):  # the decode instance has not read them yet
        so, outs = step(sched, runner)
        assert so.is_empty and outs == []
        assert sched.blocks_in_use == 3 and sched.has_pending_work()
    step(sched, runner, finished_sending={"p"})
    assert sched.blocks_in_use == 0 and not sched.has_pending_work()
    assert len(calls(conn, "request_finished", "p")) == 1
    finish(sched, runner)


# ------------------------------------------------------------------ admission under block pressure


def test_load_waits_for_blocks_and_starts_no_transfer_until_they_free_up():
    sched, conn, runner = setup(num_blocks=4)
    hog = make_request(prompt(10, 100), request_id="hog", max_tokens=2)  # 3 of the 4 blocks
    sched.add_request(hog)
    step(sched, runner)
    a = make_request(prompt(8, 300), request_id="a", max_tokens=2)  # a load into 2 blocks
    conn.set_external_tokens(8, load_async=True, request_id="a")
    sched.add_request(a)
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"hog": 1} and hog.is_finished
    assert a.status == RequestStatus.WAITING
    assert calls(conn, "get_num_new_matched_tokens", "a")  # asked ...
    assert not calls(conn, "update_state_after_alloc", "a")  # ... but nothing started
    assert all(not meta.loads for meta in runner.worker.bound)
    so, _ = step(sched, runner)  # the hog's blocks are free now
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(calls(conn, "update_state_after_alloc", "a")) == 1
    assert [load.req_id for load in runner.worker.bound[-1].loads] == ["a"]
    step(sched, runner, finished_recving={"a"})
    finish(sched, runner)
    assert a.output_token_ids == expected_tokens(a.prompt_token_ids, 2)


# ------------------------------------------------------------------ preemption


def test_preemption_after_a_receive_resumes_with_the_same_tokens():
    sched, conn, runner = setup(num_blocks=8, auto_finish_recving_after=1)
    early = make_request(prompt(6, 200), request_id="early", max_tokens=14)
    a = make_request(prompt(10, 100), request_id="a", max_tokens=12)
    conn.set_external_tokens(10, load_async=True, request_id="a")
    sched.add_request(early)
    sched.add_request(a)
    step(sched, runner)
    step(sched, runner)  # the load settles at the end of this step
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"early": 1, "a": 1}
    finish(sched, runner)
    assert a.num_preemptions >= 1  # "a" was admitted last: it is the one preempted
    # Resumed, it is admitted afresh: the connector is asked again (on top of the local hit).
    assert len(calls(conn, "get_num_new_matched_tokens", "a")) > 1
    assert len(calls(conn, "update_state_after_alloc", "a")) == 1 + a.num_preemptions
    assert early.output_token_ids == expected_tokens(early.prompt_token_ids, 14)
    assert a.output_token_ids == expected_tokens(a.prompt_token_ids, 12)


# ------------------------------------------------------------------ aborts


def test_abort_before_scheduling_still_tells_the_connector():
    sched, conn, runner = setup()
    conn.set_external_tokens(8, load_async=True, request_id="a")
    sched.add_request(make_request(prompt(9, 100), request_id="a"))
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert calls(conn, "request_finished", "a") == [("request_finished", "a", [])]
    _, outs = step(sched, runner)
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort")]
    assert not calls(conn, "update_state_after_alloc", "a")
    finish(sched, runner)


@pytest.mark.parametrize("settles_by", ["finished_recving", "failed_recving"])
def test_abort_while_waiting_for_remote_kv_frees_blocks_after_load_settles(settles_by):
    sched, conn, runner = setup()
    conn.set_external_tokens(10, load_async=True, request_id="a")
    sched.add_request(make_request(prompt(10, 100), request_id="a"))
    step(sched, runner)
    held = sched.kv_cache_manager.get_block_ids("a")
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert calls(conn, "request_finished", "a") == [("request_finished", "a", held)]
    _, outs = step(sched, runner)
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort")]
    for _ in range(2):  # a late write may still land in them: they must not be reused
        assert sched.blocks_in_use == 3 and sched.has_pending_work()
        step(sched, runner)
    step(sched, runner, **{settles_by: {"a"}})
    assert sched.blocks_in_use == 0
    finish(sched, runner)


@pytest.mark.parametrize("first, last", [("finished_sending", "finished_recving"),
                                         ("finished_recving", "finished_sending")])
def test_abort_while_loading_with_the_connector_holding_frees_after_both_settle(first, last):
    sched, conn, runner = setup()
    conn.delay_free = ["a"]
    conn.set_external_tokens(10, load_async=True, request_id="a")
    sched.add_request(make_request(prompt(10, 100), request_id="a"))
    step(sched, runner)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    step(sched, runner, **{first: {"a"}})
    assert sched.blocks_in_use == 3 and sched.has_pending_work()
    step(sched, runner, **{last: {"a"}})
    assert sched.blocks_in_use == 0
    finish(sched, runner)


def test_abort_after_the_load_settled_frees_at_once_and_the_id_can_be_reused():
    sched, conn, runner = setup()
    conn.set_external_tokens(10, load_async=True, request_id="a")
    sched.add_request(make_request(prompt(10, 100), request_id="a"))
    step(sched, runner)
    step(sched, runner, finished_recving={"a"})  # settled, not yet promoted
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert sched.blocks_in_use == 0
    step(sched, runner)
    again = make_request(prompt(10, 100), request_id="a", max_tokens=2)
    sched.add_request(again)
    for _ in range(2):  # its own load has not settled: nothing may run on its blocks
        so, _ = step(sched, runner)
        assert so.num_scheduled_tokens == {}
        assert again.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step(sched, runner, finished_recving={"a"})
    finish(sched, runner)
    assert again.output_token_ids == expected_tokens(again.prompt_token_ids, 2)


@pytest.mark.parametrize("held_by_connector", [False, True])
def test_abort_after_finishing_is_a_no_op(held_by_connector):
    sched, conn, runner = setup()
    conn.delay_free = ["a"] if held_by_connector else []
    a = make_request(prompt(10, 100), request_id="a", max_tokens=1)
    sched.add_request(a)
    _, outs = step(sched, runner)
    assert outs[0].finish_reason == "length"
    in_use = sched.blocks_in_use
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and sched.blocks_in_use == in_use
    assert len(calls(conn, "request_finished", "a")) == 1
    _, outs = step(sched, runner, finished_sending={"a"})
    assert outs == []
    finish(sched, runner)

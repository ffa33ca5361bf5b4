"""The scheduler with a KV connector (FakeConnector + FakeRunner): load failures under both
policies, invalid blocks, pending work and statistics. Every test ends with no block in use."""

from __future__ import annotations

import pytest

from kvrelay.core.sched_output import SchedulerOutput
from kvrelay.request import RequestStatus
from tests.core.connector_harness import (
    BLOCK_SIZE,
    calls,
    execute,
    finish,
    new_req_data,
    num_hit_tokens,
    prompt,
    setup,
    step,
)
from tests.helpers import expected_tokens, make_request

# ------------------------------------------------------------------ failures


def test_failed_receive_under_recompute_resets_to_the_local_prefix():
    sched, conn, runner = setup()
    base = prompt(8, 100)
    sched.add_request(make_request(base + [7], request_id="first", max_tokens=1))
    finish(sched, runner)
    p = base + prompt(6, 500)
    a = make_request(p, request_id="a", max_tokens=3)
    conn.set_external_tokens(14, load_async=True, request_id="a")
    sched.add_request(a)
    step(sched, runner)
    step(sched, runner, failed_recving={"a"})
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 6}  # everything after the 8-token local hit
    assert new_req_data(so, "a").num_computed_tokens == 8
    assert len(calls(conn, "update_state_after_alloc", "a")) == 1  # no second transfer
    finish(sched, runner)
    assert a.output_token_ids == expected_tokens(p, 3)
    assert sched.stats.kv_load_failures == 1
    assert sched.stats.prompt_tokens_external == 0


@pytest.mark.parametrize("load_async", [True, False])
def test_failure_under_fail_policy_ends_the_request_with_an_error(load_async):
    sched, conn, runner = setup(policy="fail")
    p = prompt(14, 100)
    a = make_request(p, request_id="a", max_tokens=3)
    other = make_request(prompt(5, 300), request_id="other", max_tokens=3)
    conn.set_external_tokens(12, load_async=load_async, request_id="a")
    sched.add_request(a)
    sched.add_request(other)
    so = sched.schedule()
    if load_async:
        execute(sched, runner, so)
        _, outs = step(sched, runner, failed_recving={"a"})
    else:
        assert so.num_scheduled_tokens == {"a": 2, "other": 5}
        bad = sched.kv_cache_manager.get_block_ids("a")[1]
        outs = execute(sched, runner, so, invalid_block_ids={bad})
    errors = [o for o in outs if o.request_id == "a"]
    assert [(o.finish_reason, o.new_token_ids) for o in errors] == [("error", [])]
    assert errors[0].error is not None and "kv_load_failure_policy=fail" in errors[0].error
    assert a.status == RequestStatus.FINISHED_ERROR and a.output_token_ids == []
    assert len(calls(conn, "request_finished", "a")) == 1
    finish(sched, runner)
    assert other.output_token_ids == expected_tokens(other.prompt_token_ids, 3)
    assert sched.stats.kv_load_failures == 1


@pytest.mark.parametrize("reported", ["with_finished_recving", "while_loading"])
@pytest.mark.parametrize("bad_index", [0, 1, 2])
def test_invalid_blocks_of_an_async_load_truncate_to_the_first_invalid_block(bad_index, reported):
    sched, conn, runner = setup()
    kv = sched.kv_cache_manager
    p = prompt(12, 100)  # three full blocks, all of them loaded
    a = make_request(p, request_id="a", max_tokens=3)
    conn.set_external_tokens(12, load_async=True, request_id="a")
    sched.add_request(a)
    step(sched, runner)
    blocks = kv.get_block_ids("a")
    bad = blocks[bad_index]
    if reported == "while_loading":
        step(sched, runner, invalid_block_ids={bad})
        assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # the load goes on
        step(sched, runner, finished_recving={"a"})
    else:
        step(sched, runner, finished_recving={"a"}, invalid_block_ids={bad})
    so = sched.schedule()
    valid = bad_index * BLOCK_SIZE
    assert so.num_scheduled_tokens == {"a": 12 - valid}
    sent = new_req_data(so, "a")
    assert sent.num_computed_tokens == valid and sent.block_ids == blocks  # recomputed in place
    # Only the leading valid blocks are published; the bad one and those after it are not.
    assert num_hit_tokens(sched, p + [999]) == valid
    published = {block.block_id for block in kv.block_pool.cached_blocks.values()}
    assert not published & set(blocks[bad_index:])
    execute(sched, runner, so)
    finish(sched, runner)
    assert a.output_token_ids == expected_tokens(p, 3)
    assert len(calls(conn, "update_state_after_alloc", "a")) == 1  # no second transfer
    assert sched.stats.kv_load_failures == 1
    assert sched.stats.prompt_tokens_external == valid


@pytest.mark.parametrize("bad_index", [0, 1, 2])
def test_sync_load_with_invalid_blocks_discards_the_token_and_recomputes(bad_index):
    sched, conn, runner = setup()
    kv = sched.kv_cache_manager
    p = prompt(14, 100)
    a = make_request(p, request_id="a", max_tokens=3)
    conn.set_external_tokens(12, request_id="a")  # load_async=False: loaded inside the step
    sched.add_request(a)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 2}
    bad = kv.get_block_ids("a")[bad_index]
    outs = execute(sched, runner, so, invalid_block_ids={bad})
    assert outs == [] and a.output_token_ids == []  # its token was sampled on top of bad KV
    valid = bad_index * BLOCK_SIZE
    assert a.num_computed_tokens == valid and a.status == RequestStatus.RUNNING
    assert num_hit_tokens(sched, p) == 0  # nothing of the failed step was published
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 14 - valid}
    sent = new_req_data(so, "a")  # the runner gets it afresh, with its new block list
    assert sent.num_computed_tokens == valid and sent.block_ids == kv.get_block_ids("a")
    assert sent.block_ids[:bad_index] == kv.get_block_ids("a")[:bad_index]
    execute(sched, runner, so)
    finish(sched, runner)
    assert a.output_token_ids == expected_tokens(p, 3)
    stats = sched.stats
    assert stats.kv_load_failures == 1
    assert (stats.prompt_tokens_external, stats.prompt_tokens_computed) == (valid, 14 - valid)


def scheduled_ranges(so: SchedulerOutput) -> dict[str, range]:
    """The token positions each request computes in this step."""
    starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    starts.update({r.req_id: r.num_computed_tokens for r in so.scheduled_cached_reqs})
    return {rid: range(starts[rid], starts[rid] + n) for rid, n in so.num_scheduled_tokens.items()}


def test_an_invalid_block_is_never_shared_and_its_tokens_are_computed_once():
    # NOTE: blocks are published only after the step that filled them succeeded, so a second
    # request with the same prompt cannot hit a block whose load failed; it hits the recomputed one.
    sched, conn, runner = setup(max_num_batched_tokens=10)
    kv = sched.kv_cache_manager
    p = prompt(14, 100)
    a = make_request(p, request_id="a", max_tokens=3)
    b = make_request(p, request_id="b", max_tokens=3)
    conn.set_external_tokens(12, request_id="a")
    sched.add_request(a)
    so = sched.schedule()
    bad = kv.get_block_ids("a")[1]
    execute(sched, runner, so, invalid_block_ids={bad})
    sched.add_request(b)
    assert num_hit_tokens(sched, p) == 0
    steps = [step(sched, runner)[0]]
    assert steps[0].num_scheduled_tokens == {"a": 10}  # "a" recomputes from the bad block: no budget left
    recomputed = kv.get_block_ids("a")[:3]
    steps.append(step(sched, runner)[0])
    assert steps[1].num_scheduled_tokens == {"a": 1, "b": 2}  # "b" hits the recomputed blocks
    assert kv.get_block_ids("b")[:3] == recomputed and b.num_cached_tokens == 12
    while sched.has_pending_work():
        steps.append(step(sched, runner)[0])
    bad_positions = set(range(BLOCK_SIZE, 2 * BLOCK_SIZE))
    computed_bad_block = [rid for so in steps for rid, positions in scheduled_ranges(so).items()
                          if bad_positions & set(positions)]
    assert computed_bad_block == ["a"]
    finish(sched, runner)
    assert a.output_token_ids == b.output_token_ids == expected_tokens(p, 3)


# ------------------------------------------------------------------ pending work and stats


def test_engine_loop_keeps_stepping_until_loads_and_held_blocks_settle():
    sched, conn, runner = setup(auto_finish_recving_after=3, auto_finish_sending_after=4)
    conn.delay_free = ["p"]
    conn.set_external_tokens(10, load_async=True, request_id="d")
    d = make_request(prompt(10, 100), request_id="d", max_tokens=1)
    p = make_request(prompt(6, 300), request_id="p", max_tokens=1)
    sched.add_request(d)
    sched.add_request(p)
    step(sched, runner)
    assert p.is_finished and sched.has_pending_work()
    tokens = finish(sched, runner)
    # Step 1 prefills "p"; "d"'s load settles at the end of step 4; step 5 computes its last
    # prompt token; "p"'s blocks come back at the end of step 6.
    assert runner.computed_tokens_per_step == [6, 0, 0, 0, 1, 0]
    assert tokens == {"d": expected_tokens(d.prompt_token_ids, 1)}
    assert p.output_token_ids == expected_tokens(p.prompt_token_ids, 1)


def test_held_blocks_alone_keep_the_scheduler_busy():
    sched, conn, runner = setup()
    conn.delay_free = ["p"]
    sched.add_request(make_request(prompt(6, 300), request_id="p", max_tokens=1))
    step(sched, runner)
    conn.holding.clear()  # even a connector that forgets: the scheduler knows it lent blocks
    assert not sched.has_unfinished_requests() and sched.has_pending_work()
    step(sched, runner, finished_sending={"p"})
    assert not sched.has_pending_work()
    finish(sched, runner)


def test_prompt_token_stats_add_up_by_source():
    sched, conn, runner = setup(auto_finish_recving_after=1)
    base = prompt(8, 100)
    sched.add_request(make_request(base + [1, 2], request_id="local"))  # computes 10
    finish(sched, runner)
    requests = [
        make_request(base + [3, 4, 5], request_id="hit"),  # 8 cached, 3 computed
        make_request(prompt(12, 500), request_id="remote"),  # 11 external, 1 computed
        make_request(base + prompt(6, 700), request_id="remote_on_hit"),  # 8 cached, 5 external, 1 computed
        make_request(prompt(14, 900), request_id="sync"),  # 12 external, 2 computed
    ]
    conn.set_external_tokens(12, load_async=True, request_id="remote")
    conn.set_external_tokens(14, load_async=True, request_id="remote_on_hit")
    conn.set_external_tokens(12, request_id="sync")
    for req in requests:
        sched.add_request(req)
    finish(sched, runner)
    stats = sched.stats
    assert stats.prompt_tokens_cached == 16
    assert stats.prompt_tokens_external == 28
    assert dict(stats.prompt_tokens_external_by_connector) == {"FakeConnector": 28}
    assert stats.prompt_tokens_computed == 10 + 3 + 1 + 1 + 2
    total = 10 + sum(req.num_prompt_tokens for req in requests)
    assert stats.prompt_tokens_computed + stats.prompt_tokens_cached + stats.prompt_tokens_external == total
    for req in requests:
        assert req.output_token_ids == expected_tokens(req.prompt_token_ids, 4)


# ------------------------------------------------------------------ invalid KV leaves the prefix cache


def published_block_ids(sched) -> set[int]:
    return {block.block_id for block in sched.kv_cache_manager.block_pool.cached_blocks.values()}


def report_invalid(policy: str, load_async: bool, when: str):
    """Request "a" (12-token prompt, three blocks) loads all of its prompt and its second block
    is reported invalid `when`: "in_step" (with the sync load's own step, or with the async
    load's settling), "while_loading" (async, before it settles) or "late" (after its blocks
    were computed and published). Returns right after the step that reported it."""
    sched, conn, runner = setup(policy=policy)
    a = make_request(prompt(12, 100), request_id="a", max_tokens=3)
    conn.set_external_tokens(12, load_async=load_async, request_id="a")
    sched.add_request(a)
    so = sched.schedule()
    blocks = sched.kv_cache_manager.get_block_ids("a")
    bad = {blocks[1]}
    if not load_async:
        execute(sched, runner, so, **({"invalid_block_ids": bad} if when == "in_step" else {}))
    elif when == "while_loading":
        execute(sched, runner, so, invalid_block_ids=bad)
        assert not published_block_ids(sched) & set(blocks[1:])
        step(sched, runner, finished_recving={"a"})
    else:
        execute(sched, runner, so)
        events = {"invalid_block_ids": bad} if when == "in_step" else {}
        step(sched, runner, finished_recving={"a"}, **events)
    if when == "late":
        if load_async:
            step(sched, runner)  # promoted: computes its last prompt token
        assert published_block_ids(sched) >= set(blocks)  # everything was published meanwhile
        step(sched, runner, invalid_block_ids=bad)
    return sched, runner, a, blocks


REPORT_TIMES = [(False, "in_step"), (False, "late"), (True, "in_step"), (True, "while_loading"),
                (True, "late")]


@pytest.mark.parametrize(("load_async", "when"), REPORT_TIMES)
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_block_found_invalid_never_stays_in_the_prefix_cache(policy, load_async, when):
    sched, runner, a, blocks = report_invalid(policy, load_async, when)
    p = a.prompt_token_ids
    # Neither the bad block nor any block after it can be hit, by any later request.
    assert not published_block_ids(sched) & set(blocks[1:])
    assert num_hit_tokens(sched, p + [999]) <= BLOCK_SIZE
    if policy == "fail":
        assert a.status == RequestStatus.FINISHED_ERROR
    finish(sched, runner)
    if policy == "recompute":
        assert a.output_token_ids == expected_tokens(p, 3)
    # A later request with the same prompt hits only KV that is valid: the first block, or
    # what "a" recomputed in place.
    b = make_request(p, request_id="b", max_tokens=1)
    sched.add_request(b)
    finish(sched, runner)
    if policy == "fail":
        assert b.num_cached_tokens <= BLOCK_SIZE
    else:
        assert b.num_cached_tokens == 8
    assert b.output_token_ids == expected_tokens(p, 1)
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_late_invalid_report_also_rolls_back_a_request_that_hit_the_block(policy):
    sched, conn, runner = setup(policy=policy)
    p = prompt(12, 100)
    a = make_request(p, request_id="a", max_tokens=6)
    conn.set_external_tokens(12, load_async=True, request_id="a")
    sched.add_request(a)
    step(sched, runner)
    blocks = sched.kv_cache_manager.get_block_ids("a")
    step(sched, runner, finished_recving={"a"})
    step(sched, runner)  # "a" computes its last prompt token; its blocks are published
    hitter = make_request(p + prompt(3, 700), request_id="hitter", max_tokens=2)
    sched.add_request(hitter)
    step(sched, runner)
    assert sched.kv_cache_manager.get_block_ids("hitter")[:3] == blocks  # it hit all three
    step(sched, runner, invalid_block_ids={blocks[1]})
    assert not published_block_ids(sched) & set(blocks[1:])
    for req in (a, hitter):
        if policy == "fail":
            assert req.status == RequestStatus.FINISHED_ERROR
        else:
            assert req.num_computed_tokens <= BLOCK_SIZE and req.status == RequestStatus.RUNNING
    finish(sched, runner)
    if policy == "recompute":
        assert a.output_token_ids == expected_tokens(p, 6)
        assert hitter.output_token_ids == expected_tokens(hitter.prompt_token_ids, 2)

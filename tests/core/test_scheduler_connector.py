"""The scheduler with a KV connector, driven by the FakeConnector (both halves) and the
FakeRunner: remote prefill on the decode side, delayed freeing on the prefill side, loads that
wait for blocks, preemption, aborts, load failures, pending work and statistics.
Every test ends with no block in use."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay.core.sched_output import SchedulerOutput
from kvrelay.core.scheduler import Scheduler
from kvrelay.kv_transfer import KVCacheSpec, KVConnectorMetadata, KVConnectorRole, KVTransferConfig, add_stats
from kvrelay.outputs import EngineCoreOutput, KVConnectorOutput, ModelRunnerOutput
from kvrelay.request import RequestStatus
from tests.helpers import FakeRunner, expected_tokens, make_config, make_request, run_to_completion
from tests.kv_transfer.fake_connector import FakeConnector, fake_transfer_config

BLOCK_SIZE = 4
KV_SPEC = KVCacheSpec(block_size=BLOCK_SIZE, num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
P2P_PARAMS = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_block_ids": [0, 1, 2]}


class ConnectorRunner(FakeRunner):
    """The FakeRunner plus the worker half of the FakeConnector: each step binds the metadata
    (sent as bytes, as across a process boundary) and reports what the worker settled, merged
    with any KVConnectorOutput queued in `kv_out` for that step."""

    def __init__(self, worker: FakeConnector) -> None:
        super().__init__(BLOCK_SIZE)
        self.worker = worker

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = super().execute(so)
        self.worker.bind_connector_metadata(KVConnectorMetadata.from_bytes(so.kv_connector_metadata.to_bytes()))
        settled = self.worker.get_finished(so.finished_req_ids)
        self.worker.clear_connector_metadata()
        if out.kv_connector_output is not None:
            queued = out.kv_connector_output
            settled.finished_sending |= queued.finished_sending
            settled.finished_recving |= queued.finished_recving
            settled.failed_recving |= queued.failed_recving
            settled.invalid_block_ids |= queued.invalid_block_ids
            add_stats(settled.stats, queued.stats)
        out.kv_connector_output = settled
        return out


def setup(num_blocks: int = 64, policy: str = "recompute", max_num_seqs: int = 16,
          max_num_batched_tokens: int = 64, **extra: Any) -> tuple[Scheduler, FakeConnector, ConnectorRunner]:
    """A scheduler with the scheduler-side FakeConnector, and a runner with the worker side;
    both halves are built from the same extra config (rules, script, auto-settling)."""
    kv_transfer = KVTransferConfig.from_any(
        {**fake_transfer_config(**extra), "kv_load_failure_policy": policy})
    config = make_config(block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, kv_transfer=kv_transfer)
    connector = FakeConnector(config, KVConnectorRole.SCHEDULER, KV_SPEC)
    sched = Scheduler(config, num_blocks, 256, connector)
    runner = ConnectorRunner(FakeConnector(config, KVConnectorRole.WORKER, KV_SPEC))
    return sched, connector, runner


def step(sched: Scheduler, runner: FakeRunner,
         **kv_events: Any) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One engine step; `kv_events` (finished_recving=..., invalid_block_ids=...) are what the
    worker-side connector reports at its end."""
    so = sched.schedule()
    return so, execute(sched, runner, so, **kv_events)


def execute(sched: Scheduler, runner: FakeRunner, so: SchedulerOutput,
            **kv_events: Any) -> list[EngineCoreOutput]:
    """The second half of a step, for tests that need the blocks scheduled before they can
    say which of them the worker reports invalid."""
    runner.kv_out = [KVConnectorOutput(**kv_events)] if kv_events else []
    return sched.update_from_output(so, runner.execute(so))


def finish(sched: Scheduler, runner: FakeRunner) -> dict[str, list[int]]:
    tokens = run_to_completion(sched, runner)
    assert sched.blocks_in_use == 0
    assert not sched.has_pending_work()
    return tokens


def prompt(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def num_hit_tokens(sched: Scheduler, token_ids: list[int]) -> int:
    """What a new request with these tokens would get from the local prefix cache now."""
    return sched.kv_cache_manager.get_computed_blocks(make_request(token_ids))[1]


def calls(connector: FakeConnector, method: str, req_id: str) -> list[tuple[Any, ...]]:
    return [c for c in connector.calls if c[0] == method and c[1] == req_id]


def new_req_data(so: SchedulerOutput, req_id: str) -> Any:
    return next(r for r in so.scheduled_new_reqs if r.req_id == req_id)


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
    assert a.num_cached_tokens == 8
    step(sched, runner, finished_recving={"a"})
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1}
    finish(sched, runner)
    assert a.output_token_ids == expected_tokens(p, 3)


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
    assert outs[0].kv_transfer_params == P2P_PARAMS
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

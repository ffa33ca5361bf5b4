"""Scheduler behaviour, driven by a fake runner (no model): budget, chunking, batching,
preemption, prefix hits, aborts, stop conditions. Every test ends with no block in use."""

from __future__ import annotations

import pytest

from kvrelay.request import RequestStatus
from tests.helpers import EOS, FakeRunner, expected_tokens, make_request, make_scheduler, run_to_completion


def _finish(sched, runner):
    tokens = run_to_completion(sched, runner)
    assert sched.blocks_in_use == 0
    return tokens


def test_single_request_prefill_then_decode():
    sched, runner = make_scheduler(), FakeRunner(4)
    req = make_request(10, max_tokens=3)
    sched.add_request(req)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {req.request_id: 10}
    assert len(so.scheduled_new_reqs) == 1
    sched.update_from_output(so, runner.execute(so))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {req.request_id: 1}
    assert so.scheduled_cached_reqs[0].new_token_ids == req.output_token_ids[-1:]
    sched.update_from_output(so, runner.execute(so))
    tokens = _finish(sched, runner)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.output_token_ids == expected_tokens(req.prompt_token_ids, 3)
    assert len(tokens[req.request_id]) == 1  # the last step's token


def test_chunked_prefill_respects_budget_and_gives_same_tokens():
    sched, runner = make_scheduler(max_num_batched_tokens=8), FakeRunner(4)
    req = make_request(30, max_tokens=5)
    sched.add_request(req)
    _finish(sched, runner)
    assert max(runner.computed_tokens_per_step) <= 8
    assert runner.computed_tokens_per_step[:4] == [8, 8, 8, 6]
    assert req.output_token_ids == expected_tokens(req.prompt_token_ids, 5)


def test_long_prefill_threshold_lets_decodes_share_steps():
    sched, runner = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8), FakeRunner(4)
    short = make_request(4, max_tokens=10)
    sched.add_request(short)
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    long = make_request(40, max_tokens=2)
    sched.add_request(long)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {short.request_id: 1, long.request_id: 8}
    sched.update_from_output(so, runner.execute(so))
    _finish(sched, runner)
    assert long.output_token_ids == expected_tokens(long.prompt_token_ids, 2)


def test_continuous_batching_requests_join_and_leave():
    sched, runner = make_scheduler(), FakeRunner(4)
    a = make_request(5, max_tokens=2)
    sched.add_request(a)
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    b = make_request([900, 901, 902, 903, 904, 905], max_tokens=6)
    sched.add_request(b)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {a.request_id: 1, b.request_id: 6}
    sched.update_from_output(so, runner.execute(so))
    assert a.is_finished and not b.is_finished
    so = sched.schedule()
    assert a.request_id in so.finished_req_ids
    assert so.num_scheduled_tokens == {b.request_id: 1}
    sched.update_from_output(so, runner.execute(so))
    _finish(sched, runner)


def test_max_num_seqs_limits_running():
    sched, runner = make_scheduler(max_num_seqs=2), FakeRunner(4)
    reqs = [make_request(4, max_tokens=3) for _ in range(5)]
    for r in reqs:
        sched.add_request(r)
    so = sched.schedule()
    assert len(so.num_scheduled_tokens) == 2
    sched.update_from_output(so, runner.execute(so))
    _finish(sched, runner)
    for r in reqs:
        assert r.output_token_ids == expected_tokens(r.prompt_token_ids, 3)


def test_preemption_and_resume_give_same_tokens_as_unconstrained_run():
    prompts = [[(i * 13 + j * 5) % 900 + 1 for j in range(10 + i)] for i in range(6)]
    # Unconstrained: plenty of blocks.
    big, big_runner = make_scheduler(num_blocks=200), FakeRunner(4)
    reqs_big = [make_request(p, max_tokens=12, request_id=f"a{i}") for i, p in enumerate(prompts)]
    for r in reqs_big:
        big.add_request(r)
    _finish(big, big_runner)
    # Constrained: 16 blocks of 4 tokens cannot hold 6 requests of ~25 tokens at once.
    small, small_runner = make_scheduler(num_blocks=16), FakeRunner(4)
    reqs_small = [make_request(p, max_tokens=12, request_id=f"b{i}") for i, p in enumerate(prompts)]
    for r in reqs_small:
        small.add_request(r)
    _finish(small, small_runner)
    assert small.stats.num_preemptions > 0
    for rb, rs in zip(reqs_big, reqs_small, strict=True):
        assert rs.output_token_ids == rb.output_token_ids == expected_tokens(rb.prompt_token_ids, 12)


def test_prefix_hit_skips_computation():
    sched, runner = make_scheduler(), FakeRunner(4)
    prompt = list(range(1, 19))  # 18 tokens: 4 full blocks + 2
    first = make_request(prompt, max_tokens=2)
    sched.add_request(first)
    _finish(sched, runner)
    second = make_request(prompt[:16] + [500, 501, 502], max_tokens=2)
    sched.add_request(second)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {second.request_id: 3}
    assert second.num_cached_tokens == 16
    sched.update_from_output(so, runner.execute(so))
    _finish(sched, runner)
    assert second.output_token_ids == expected_tokens(second.prompt_token_ids, 2)
    assert sched.stats.prompt_tokens_cached == 16


def test_identical_prompt_fully_cached_still_computes_last_token():
    sched, runner = make_scheduler(), FakeRunner(4)
    prompt = list(range(1, 17))  # exactly 4 blocks
    sched.add_request(make_request(prompt, max_tokens=1))
    _finish(sched, runner)
    again = make_request(prompt, max_tokens=1)
    sched.add_request(again)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {again.request_id: 4}  # last block recomputed: hit capped at 12
    sched.update_from_output(so, runner.execute(so))
    _finish(sched, runner)


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "decoding", "finished"])
def test_abort_at_any_point_frees_blocks(when):
    sched, runner = make_scheduler(max_num_batched_tokens=8), FakeRunner(4)
    req = make_request(20, max_tokens=50)
    other = make_request(6, max_tokens=3)
    sched.add_request(req)
    steps = {"waiting": 0, "mid_prefill": 1, "decoding": 4, "finished": 60}[when]
    for _ in range(steps):
        if not sched.has_pending_work():
            break
        so = sched.schedule()
        sched.update_from_output(so, runner.execute(so))
    sched.add_request(other)
    sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    assert req.is_finished
    _finish(sched, runner)
    assert other.output_token_ids == expected_tokens(other.prompt_token_ids, 3)
    assert req.request_id not in sched.requests


def test_abort_output_reports_abort():
    sched, runner = make_scheduler(), FakeRunner(4)
    req = make_request(5, max_tokens=5)
    sched.add_request(req)
    sched.finish_requests([req.request_id, "unknown-id"], RequestStatus.FINISHED_ABORTED)
    so = sched.schedule()
    outs = sched.update_from_output(so, runner.execute(so))
    assert [(o.request_id, o.finish_reason) for o in outs] == [(req.request_id, "abort")]
    _finish(sched, runner)


def test_stop_on_eos_unless_ignored_and_min_tokens():
    from tests.helpers import next_token

    # Find a prompt whose first generated token is the EOS id of the fake model... instead,
    # declare the fake model's first output token an EOS for this request.
    prompt = [3, 4, 5]
    first = next_token(prompt)
    sched, runner = make_scheduler(), FakeRunner(4)
    stop = make_request(prompt, max_tokens=5, ignore_eos=False)
    stop.eos_token_ids = (first,)
    ignore = make_request(prompt, max_tokens=5, ignore_eos=True)
    ignore.eos_token_ids = (first,)
    later = make_request(prompt, max_tokens=5, ignore_eos=False, min_tokens=2)
    later.eos_token_ids = (first,)
    ids = make_request(prompt, max_tokens=5, stop_token_ids=[first])
    for r in (stop, ignore, later, ids):
        sched.add_request(r)
    _finish(sched, runner)
    assert stop.output_token_ids == [first] and stop.status == RequestStatus.FINISHED_STOPPED
    assert stop.stop_reason is None
    assert len(ignore.output_token_ids) == 5 and ignore.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert len(later.output_token_ids) == 5  # the fake model never repeats `first` after it
    assert ids.output_token_ids == [first] and ids.stop_reason == first
    assert EOS not in stop.eos_token_ids


def test_max_model_len_caps_generation():
    sched, runner = make_scheduler(max_model_len=12), FakeRunner(4)
    req = make_request(10, max_tokens=50)
    sched.add_request(req)
    _finish(sched, runner)
    assert req.num_tokens == 12 and req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_duplicate_request_id_rejected():
    sched = make_scheduler()
    sched.add_request(make_request(3, request_id="same"))
    with pytest.raises(ValueError, match="same"):
        sched.add_request(make_request(3, request_id="same"))
    sched.finish_requests("same", RequestStatus.FINISHED_ABORTED)
    assert sched.blocks_in_use == 0


def test_waiting_request_does_not_overtake_when_blocks_run_out():
    sched, runner = make_scheduler(num_blocks=8), FakeRunner(4)
    big = make_request([500 + i for i in range(28)], max_tokens=2)  # 7 blocks for the prompt alone
    sched.add_request(make_request([100 + i for i in range(8)], max_tokens=6))
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    sched.add_request(big)
    small = make_request([300, 301, 302], max_tokens=1)
    sched.add_request(small)
    so = sched.schedule()
    assert big.request_id not in so.num_scheduled_tokens
    assert small.request_id not in so.num_scheduled_tokens  # FCFS: no overtaking
    sched.update_from_output(so, runner.execute(so))
    _finish(sched, runner)
    assert big.output_token_ids == expected_tokens(big.prompt_token_ids, 2)

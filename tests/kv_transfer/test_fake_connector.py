"""The FakeConnector that scheduler and engine tests rely on behaves as its docstring says."""

from kvrelay.kv_transfer import KVConnectorRole, create_connector
from kvrelay.outputs import KVConnectorOutput
from tests.kv_transfer.builders import engine_config, kv_caches, kv_spec, request, sched_output, worker_step
from tests.kv_transfer.fake_connector import (
    FakeConnector,
    FakeConnectorMetadata,
    capture_fake_connectors,
    fake_transfer_config,
)


def make_pair(**extra):
    config = engine_config(fake_transfer_config(**extra))
    with capture_fake_connectors() as created:
        scheduler = create_connector(config, KVConnectorRole.SCHEDULER, kv_spec())
        worker = create_connector(config, KVConnectorRole.WORKER, kv_spec())
    assert created == [scheduler, worker]
    assert isinstance(scheduler, FakeConnector) and isinstance(worker, FakeConnector)
    worker.register_kv_caches(kv_caches(kv_spec(), random=False))
    return scheduler, worker


def test_external_tokens_match_by_prompt_or_request_id_on_top_of_the_local_hit():
    scheduler, _ = make_pair(external_tokens=[{"prompt_token_ids": [1, 2, 3, 4, 5], "available_tokens": 4},
                                              {"request_id": "b", "available_tokens": 8, "load_async": True}])
    assert scheduler.get_num_new_matched_tokens(request([1, 2, 3, 4, 5], "a"), 0) == (4, False)
    assert scheduler.get_num_new_matched_tokens(request([9] * 9, "b"), 4) == (4, True)
    assert scheduler.get_num_new_matched_tokens(request([9] * 9, "b"), 8) == (0, False)
    assert scheduler.get_num_new_matched_tokens(request([9] * 9, "c"), 0) == (0, False)
    scheduler.set_external_tokens(12, request_id="c")
    assert scheduler.get_num_new_matched_tokens(request([9] * 9, "c"), 0) == (12, False)


def test_async_load_settles_after_the_configured_steps_and_calls_are_recorded():
    scheduler, worker = make_pair(external_tokens=[{"available_tokens": 8, "load_async": True}],
                                  auto_finish_recving_after=1)
    req = request([7] * 9)
    num_external, _ = scheduler.get_num_new_matched_tokens(req, 0)
    scheduler.update_state_after_alloc(req, [3, 4], num_external)
    assert scheduler.has_pending_work()
    first = worker_step(worker, scheduler.build_connector_meta(sched_output()))
    second = worker_step(worker, scheduler.build_connector_meta(sched_output()))
    assert not first.finished_recving and second.finished_recving == {"r1"}
    scheduler.update_connector_output(second)
    assert not scheduler.has_pending_work()
    assert worker.call_names()[1:8] == ["bind_connector_metadata", "start_load_kv", "wait_for_layer_load",
                                        "save_kv_layer", "wait_for_layer_load", "save_kv_layer",
                                        "wait_for_save"]
    assert scheduler.calls[1] == ("update_state_after_alloc", "r1", [3, 4], 8)


def test_scripted_events_are_reported_on_their_step():
    _, worker = make_pair(script={"2": {"failed_recving": ["x"], "invalid_block_ids": [5]}})
    worker.schedule_event(1, "finished_sending", ["y"])
    outputs = [worker_step(worker, FakeConnectorMetadata()) for _ in range(3)]
    assert outputs[0] == KVConnectorOutput(finished_sending={"y"})
    assert outputs[1] == KVConnectorOutput(failed_recving={"x"}, invalid_block_ids={5})
    assert outputs[2].is_empty()


def test_request_finished_holds_blocks_and_returns_params_as_configured():
    scheduler, worker = make_pair(delay_free=["held"], kv_transfer_params={"p": 1},
                                  kv_transfer_params_by_request={"held": {"q": 2}},
                                  auto_finish_sending_after=0)
    assert scheduler.request_finished(request([1], "held"), [0, 1]) == (True, {"q": 2})
    assert scheduler.request_finished(request([1], "other"), [2]) == (False, {"p": 1})
    output = worker_step(worker, scheduler.build_connector_meta(sched_output()))
    assert output.finished_sending == {"held"}
    scheduler.update_connector_output(output)
    assert not scheduler.has_pending_work()

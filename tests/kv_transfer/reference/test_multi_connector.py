import pytest
import torch

from kvrelay.kv_transfer import KVConnectorMetadata, KVConnectorRole, create_connector
from kvrelay.kv_transfer.reference.multi import MultiConnector
from tests.kv_transfer.builders import (
    engine_config,
    kv_caches,
    kv_spec,
    prefill,
    request,
    sched_output,
    worker_step,
)
from tests.kv_transfer.fake_connector import fake_transfer_config
from tests.kv_transfer.reference.test_example_connector import PROMPT, save_prompt


def example_child(path):
    return {"kv_connector": "ExampleConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


def make_multi(children, role=KVConnectorRole.SCHEDULER, **parent):
    config = engine_config({"kv_connector": "MultiConnector",
                            "kv_connector_extra_config": {"connectors": children}, **parent})
    connector = create_connector(config, role, kv_spec())
    assert isinstance(connector, MultiConnector)
    return connector


def make_pair(children):
    scheduler = make_multi(children)
    worker = make_multi(children, KVConnectorRole.WORKER)
    worker.register_kv_caches(kv_caches(kv_spec(), random=False))
    return scheduler, worker


def children_meta(meta):
    return [KVConnectorMetadata.from_bytes(blob) for blob in meta.children]


@pytest.mark.parametrize("stored_in", [["b"], ["a", "b"]])
def test_loads_from_the_first_child_that_has_the_prefix(tmp_path, stored_in):
    for name in stored_in:
        produced, _ = save_prompt(tmp_path / name)
    scheduler, worker = make_pair([example_child(tmp_path / "a"), example_child(tmp_path / "b")])
    req = request(PROMPT, "r2")
    assert scheduler.get_num_new_matched_tokens(req, 0) == (8, False)
    scheduler.update_state_after_alloc(req, [5, 2, 11], 8)
    meta = scheduler.build_connector_meta(prefill(req, [5, 2, 11], 8))
    loads = [len(child.loads) for child in children_meta(meta)]
    assert loads == ([1, 0] if "a" in stored_in else [0, 1])
    worker_step(worker, meta)
    for name, cache in worker.kv_caches.items():
        assert torch.equal(cache[5], produced[name][3]) and torch.equal(cache[2], produced[name][7])


def test_saves_to_every_child_including_the_one_it_did_not_load_from(tmp_path):
    save_prompt(tmp_path / "b")
    scheduler, worker = make_pair([example_child(tmp_path / "a"), example_child(tmp_path / "b")])
    req = request(PROMPT, "r2")
    scheduler.update_state_after_alloc(req, [5, 2, 11], scheduler.get_num_new_matched_tokens(req, 0)[0])
    meta = scheduler.build_connector_meta(prefill(req, [5, 2, 11], 8))
    assert [len(child.saves) for child in children_meta(meta)] == [1, 0]
    worker_step(worker, meta)
    fresh = make_multi([example_child(tmp_path / "a")])
    assert fresh.get_num_new_matched_tokens(request(PROMPT), 0) == (8, False)


def test_new_prompt_is_saved_to_both_children(tmp_path):
    scheduler, worker = make_pair([example_child(tmp_path / "a"), example_child(tmp_path / "b")])
    req = request(PROMPT)
    meta = scheduler.build_connector_meta(prefill(req, [0, 1, 2]))
    worker_step(worker, meta)
    for name in ("a", "b"):
        assert make_multi([example_child(tmp_path / name)]).get_num_new_matched_tokens(req, 0) == (8, False)


def test_load_async_flag_comes_from_the_chosen_child():
    async_source = fake_transfer_config(external_tokens=[{"available_tokens": 8, "load_async": True}])
    scheduler = make_multi([fake_transfer_config(), async_source])
    assert scheduler.get_num_new_matched_tokens(request(PROMPT), 0) == (8, True)
    scheduler.update_state_after_alloc(request(PROMPT), [1, 2, 3], 8)
    first, second = scheduler.connectors
    assert first.calls[-1] == ("update_state_after_alloc", "r1", [1, 2, 3], 0)
    assert second.calls[-1] == ("update_state_after_alloc", "r1", [1, 2, 3], 8)
    assert scheduler.has_pending_work()


def test_kv_transfer_params_are_merged_and_a_clash_raises():
    scheduler = make_multi([fake_transfer_config(kv_transfer_params={"a": 1}),
                            fake_transfer_config(kv_transfer_params={"b": 2})])
    assert scheduler.request_finished(request(PROMPT), [0]) == (False, {"a": 1, "b": 2})
    clash = make_multi([fake_transfer_config(kv_transfer_params={"a": 1}),
                        fake_transfer_config(kv_transfer_params={"a": 1})])
    with pytest.raises(ValueError, match="kv_transfer_params key 'a' set by two connectors"):
        clash.request_finished(request(PROMPT), [0])


def test_blocks_stay_held_until_every_child_that_held_them_reported():
    children = [fake_transfer_config(delay_free=True), fake_transfer_config(delay_free=True),
                fake_transfer_config()]
    scheduler, worker = make_pair(children)
    assert scheduler.request_finished(request(PROMPT), [0, 1, 2]) == (True, None)
    assert scheduler.has_pending_work()
    worker.connectors[0].schedule_event(1, "finished_sending", ["r1"])
    worker.connectors[1].schedule_event(2, "finished_sending", ["r1"])
    step1 = worker_step(worker, scheduler.build_connector_meta(sched_output()))
    assert not step1.finished_sending
    scheduler.update_connector_output(step1)
    step2 = worker_step(worker, scheduler.build_connector_meta(sched_output()))
    assert step2.finished_sending == {"r1"}
    scheduler.update_connector_output(step2)
    assert not scheduler.has_pending_work()


def test_a_report_that_arrives_before_the_worker_knows_the_holders_is_kept():
    scheduler, worker = make_pair([fake_transfer_config(delay_free=True), fake_transfer_config()])
    worker.connectors[0].schedule_event(1, "finished_sending", ["r1"])
    early = worker_step(worker, scheduler.build_connector_meta(sched_output()))
    assert not early.finished_sending
    scheduler.request_finished(request(PROMPT), [0])
    later = worker_step(worker, scheduler.build_connector_meta(sched_output()))
    assert later.finished_sending == {"r1"}


def test_worker_stats_are_counted_once(tmp_path):
    scheduler, worker = make_pair([example_child(tmp_path / "a"), example_child(tmp_path / "b")])
    req = request(PROMPT)
    meta = scheduler.build_connector_meta(prefill(req, [0, 1, 2]))
    scheduler.update_connector_output(worker_step(worker, meta))
    assert scheduler.take_stats()["bytes_saved"] == 2 * kv_spec().num_layers * 2 * kv_spec().block_bytes
    assert scheduler.take_stats() == {}


def test_children_inherit_role_and_engine_id_unless_they_set_their_own(tmp_path):
    multi = make_multi([example_child(tmp_path), {**fake_transfer_config(), "kv_role": "kv_consumer"}],
                       kv_role="kv_producer", engine_id="engine-7")
    roles = [(c.transfer_config.kv_role, c.transfer_config.engine_id) for c in multi.connectors]
    assert roles == [("kv_producer", "engine-7"), ("kv_consumer", "engine-7")]


@pytest.mark.parametrize("children,match", [
    ([], "at least one child"),
    (["ExampleConnector"], r"connectors\[0\] must be a dict"),
    ([{"kv_connector": "FakeConnector", "bogus": 1}], r"connectors\[0\]: unknown kv_transfer_config key"),
])
def test_bad_child_configs_are_rejected_with_their_index(children, match):
    with pytest.raises(ValueError, match=match):
        make_multi(children)


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_shutdown_reaches_every_child_even_after_one_raises(tmp_path, monkeypatch, role):
    multi = make_multi([example_child(tmp_path / "a"), example_child(tmp_path / "b")], role)
    calls = []

    def failing() -> None:
        calls.append("a")
        raise RuntimeError("a child that cannot stop cleanly")

    monkeypatch.setattr(multi.connectors[0], "shutdown", failing)
    monkeypatch.setattr(multi.connectors[1], "shutdown", lambda: calls.append("b"))
    with pytest.raises(RuntimeError, match="cannot stop cleanly"):
        multi.shutdown()
    assert calls == ["a", "b"]


def test_shutdown_stops_an_offload_child_s_threads(tmp_path):
    import threading

    offload = {"kv_connector": "OffloadConnector",
               "kv_connector_extra_config": {"chunk_tokens": 16, "cpu_bytes": "1MiB"}}
    scheduler, worker = make_pair([example_child(tmp_path / "a"), offload])
    assert any(t.name.startswith("kvrelay-offload") for t in threading.enumerate())
    worker.shutdown()
    scheduler.shutdown()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("kvrelay-offload")]

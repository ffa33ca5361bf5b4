"""Connector metadata crosses a process boundary: every connector's must survive bytes."""

import msgspec
import pytest

from kvrelay.kv_transfer import KVConnectorMetadata, KVConnectorRole, create_connector
from kvrelay.kv_transfer.reference.example import ExampleConnectorMetadata, LoadSpec, SaveSpec
from kvrelay.kv_transfer.reference.multi import MultiConnectorMetadata
from tests.kv_transfer.builders import engine_config, kv_spec, new_req, prefill, request, sched_output
from tests.kv_transfer.fake_connector import FakeConnectorMetadata, FakeLoad, fake_transfer_config
from tests.kv_transfer.reference.test_example_connector import PROMPT, save_prompt


def round_trip(meta: KVConnectorMetadata) -> KVConnectorMetadata:
    back = KVConnectorMetadata.from_bytes(meta.to_bytes())
    assert type(back) is type(meta) and back == meta
    return back


def test_base_metadata_round_trips():
    round_trip(KVConnectorMetadata())


def test_example_metadata_round_trips(tmp_path):
    round_trip(ExampleConnectorMetadata(loads=[LoadSpec("r1", "k" * 40, [5, 2], 0)],
                                        saves=[SaveSpec("r2", "j" * 40, [1, 3])]))
    save_prompt(tmp_path)
    config = engine_config({"kv_connector": "ExampleConnector",
                            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    scheduler = create_connector(config, KVConnectorRole.SCHEDULER, kv_spec())
    loaded, fresh = request(PROMPT, "a"), request([9] * 11, "b")
    scheduler.update_state_after_alloc(loaded, [4, 5, 6], scheduler.get_num_new_matched_tokens(loaded, 0)[0])
    meta = scheduler.build_connector_meta(sched_output(
        new=[new_req(loaded, [4, 5, 6], 8), new_req(fresh, [7, 8, 9])], num_scheduled={"a": 3, "b": 11}))
    assert isinstance(meta, ExampleConnectorMetadata) and meta.loads and meta.saves
    round_trip(meta)


def test_fake_metadata_round_trips():
    round_trip(FakeConnectorMetadata(loads=[FakeLoad("r1", [1, 2], 8, True)], held=["r0"]))


def test_multi_metadata_round_trips_with_each_childs_own_type(tmp_path):
    example = {"kv_connector": "ExampleConnector",
               "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    fake = fake_transfer_config(delay_free=True,
                                external_tokens=[{"available_tokens": 8, "load_async": True}])
    config = engine_config({"kv_connector": "MultiConnector",
                            "kv_connector_extra_config": {"connectors": [example, fake]}})
    scheduler = create_connector(config, KVConnectorRole.SCHEDULER, kv_spec())
    req = request(PROMPT)
    scheduler.update_state_after_alloc(req, [1, 2, 3], scheduler.get_num_new_matched_tokens(req, 0)[0])
    scheduler.request_finished(request(PROMPT, "done"), [4])
    meta = scheduler.build_connector_meta(prefill(req, [1, 2, 3]))
    back = round_trip(meta)
    assert isinstance(back, MultiConnectorMetadata) and back.expected_sends == {"done": 1}
    children = [KVConnectorMetadata.from_bytes(blob) for blob in back.children]
    assert [type(c) for c in children] == [ExampleConnectorMetadata, FakeConnectorMetadata]
    assert isinstance(children[1], FakeConnectorMetadata) and children[1].loads[0].block_ids == [1, 2, 3]


def test_unknown_metadata_type_is_a_clear_error():
    blob = msgspec.msgpack.encode(("nowhere.Metadata", b""))
    with pytest.raises(ValueError, match="is its connector module imported"):
        KVConnectorMetadata.from_bytes(blob)
    with pytest.raises(ValueError, match="as ExampleConnectorMetadata"):
        ExampleConnectorMetadata.from_bytes(FakeConnectorMetadata().to_bytes())

"""ExampleConnector driven by hand: scheduler side and worker side, real (small) KV tensors."""

import pytest
import torch

from kvrelay.kv_transfer import KVConnectorRole, create_connector
from kvrelay.kv_transfer.reference.example import ExampleConnector, ExampleConnectorMetadata
from tests.kv_transfer.builders import (
    BLOCK_SIZE,
    cached_req,
    engine_config,
    kv_caches,
    kv_spec,
    new_req,
    prefill,
    request,
    sched_output,
    worker_step,
)

PROMPT = list(range(100, 111))  # 11 tokens: the stored prefix is align_down(10, 4) = 8 tokens
PREFIX_BLOCKS = 2


def make_pair(storage, spec=None, random_kv=False, seed=0):
    """A fresh scheduler-side + worker-side pair: what a new process would build."""
    spec = spec or kv_spec()
    config = engine_config({"kv_connector": "ExampleConnector",
                            "kv_connector_extra_config": {"shared_storage_path": str(storage)}})
    scheduler = create_connector(config, KVConnectorRole.SCHEDULER, spec)
    worker = create_connector(config, KVConnectorRole.WORKER, spec)
    worker.register_kv_caches(kv_caches(spec, random_kv, seed))
    return scheduler, worker


def save_prompt(storage, prompt=PROMPT, block_ids=(3, 7, 9)):
    """Run one producer step that computes the whole prompt; returns its worker's KV caches."""
    scheduler, worker = make_pair(storage, random_kv=True)
    req = request(prompt)
    meta = scheduler.build_connector_meta(
        sched_output(new=[new_req(req, list(block_ids))], num_scheduled={req.request_id: len(prompt)}))
    assert [s.block_ids for s in meta.saves] == [list(block_ids[:PREFIX_BLOCKS])]
    scheduler.update_connector_output(worker_step(worker, meta))
    return worker.kv_caches, scheduler


def load_into(storage, block_ids, num_local=0, prompt=PROMPT):
    """A fresh consumer admits the prompt with `num_local` tokens hit locally and loads the rest."""
    scheduler, worker = make_pair(storage)
    req = request(prompt, request_id="r2")
    num_external, load_async = scheduler.get_num_new_matched_tokens(req, num_local)
    scheduler.update_state_after_alloc(req, block_ids, num_external)
    num_done = num_local + num_external
    meta = scheduler.build_connector_meta(sched_output(
        new=[new_req(req, block_ids, num_done)], num_scheduled={"r2": len(prompt) - num_done}))
    output = worker_step(worker, meta)
    scheduler.update_connector_output(output)
    return (num_external, load_async), meta, output, worker, scheduler


def test_saved_prefix_is_loaded_by_a_fresh_instance_into_other_blocks(tmp_path):
    produced, _ = save_prompt(tmp_path)
    matched, meta, output, worker, scheduler = load_into(tmp_path, block_ids=[5, 2, 11])
    assert matched == (8, False)
    assert not meta.saves, "a prefix that is already stored is not saved again"
    for name, cache in worker.kv_caches.items():
        assert torch.equal(cache[5], produced[name][3]) and torch.equal(cache[2], produced[name][7])
        assert not cache[11].any(), "the block of the last prompt token is left to compute"
    assert not output.invalid_block_ids
    stats, spec = scheduler.take_stats(), kv_spec()
    assert stats["bytes_loaded"] == spec.num_layers * PREFIX_BLOCKS * spec.block_bytes
    assert stats["tokens_loaded"] == PREFIX_BLOCKS * BLOCK_SIZE and stats["seconds_loading"] >= 0
    assert scheduler.take_stats() == {}, "stats are handed out once"


def test_saved_entry_holds_one_safetensors_file_per_layer_and_no_staging_leftovers(tmp_path):
    _, scheduler = save_prompt(tmp_path)
    (entry,) = [p for p in tmp_path.iterdir()]
    assert sorted(p.name for p in entry.iterdir()) == [f"{n}.safetensors" for n in kv_spec().layer_names]
    stats = scheduler.take_stats()
    assert stats["bytes_saved"] == kv_spec().num_layers * PREFIX_BLOCKS * kv_spec().block_bytes


def test_matching_is_side_effect_free(tmp_path):
    save_prompt(tmp_path)
    scheduler, _ = make_pair(tmp_path)
    req = request(PROMPT)
    answers = [scheduler.get_num_new_matched_tokens(req, 0) for _ in range(3)]
    assert answers == [(8, False)] * 3
    assert scheduler.build_connector_meta(sched_output()) == ExampleConnectorMetadata()


def test_partial_local_hit_loads_only_the_missing_blocks(tmp_path):
    produced, _ = save_prompt(tmp_path)
    matched, meta, _, worker, _ = load_into(tmp_path, block_ids=[5, 2, 11], num_local=BLOCK_SIZE)
    assert matched == (4, False)
    assert [(load.block_ids, load.first_stored_block) for load in meta.loads] == [([2], 1)]
    for name, cache in worker.kv_caches.items():
        assert torch.equal(cache[2], produced[name][7])
        assert not cache[5].any(), "the locally cached block is not overwritten"


@pytest.mark.parametrize("num_local", [8, 10])
def test_nothing_to_load_when_the_local_hit_covers_the_prefix(tmp_path, num_local):
    save_prompt(tmp_path)
    scheduler, _ = make_pair(tmp_path)
    assert scheduler.get_num_new_matched_tokens(request(PROMPT), num_local) == (0, False)


def test_prompt_shorter_than_a_block_plus_one_is_neither_saved_nor_matched(tmp_path):
    scheduler, _ = make_pair(tmp_path)
    req = request([1, 2, 3, 4])  # align_down(3, 4) = 0
    meta = scheduler.build_connector_meta(prefill(req, [0]))
    assert not meta.saves
    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)


def test_chunked_prefill_saves_once_the_whole_prefix_is_computed(tmp_path):
    scheduler, worker = make_pair(tmp_path, random_kv=True)
    req = request(PROMPT)
    step1 = scheduler.build_connector_meta(sched_output(new=[new_req(req, [0])], num_scheduled={"r1": 4}))
    step2 = scheduler.build_connector_meta(sched_output(cached=[cached_req("r1", 4, [1])],
                                                        num_scheduled={"r1": 3}))
    assert not step1.saves and not step2.saves  # 7 of 8 prefix tokens computed
    step3 = scheduler.build_connector_meta(sched_output(cached=[cached_req("r1", 7, [2])],
                                                        num_scheduled={"r1": 4}))
    assert [(s.req_id, s.block_ids) for s in step3.saves] == [("r1", [0, 1])]
    worker_step(worker, step3)
    decode = sched_output(cached=[cached_req("r1", 11)], num_scheduled={"r1": 1})
    step4 = scheduler.build_connector_meta(decode)
    assert not step4.saves
    assert scheduler.get_num_new_matched_tokens(request(PROMPT, "r9"), 0) == (8, False)


def test_request_finished_before_its_prefix_completes_is_not_saved(tmp_path):
    scheduler, _ = make_pair(tmp_path)
    req = request(PROMPT)
    scheduler.build_connector_meta(sched_output(new=[new_req(req, [0])], num_scheduled={"r1": 4}))
    assert scheduler.request_finished(req, [0]) == (False, None)
    later = scheduler.build_connector_meta(sched_output(cached=[cached_req("r1", 4, [1, 2])],
                                                        num_scheduled={"r1": 7}))
    assert not later.saves


def test_two_requests_with_one_prompt_in_one_step_save_it_once(tmp_path):
    scheduler, _ = make_pair(tmp_path)
    a, b = request(PROMPT, "a"), request(PROMPT, "b")
    meta = scheduler.build_connector_meta(sched_output(
        new=[new_req(a, [0, 1, 2]), new_req(b, [3, 4, 5])], num_scheduled={"a": 11, "b": 11}))
    assert [s.req_id for s in meta.saves] == ["a"]


def test_an_entry_being_written_is_invisible_until_every_layer_is_there(tmp_path):
    scheduler, worker = make_pair(tmp_path, random_kv=True)
    req = request(PROMPT)
    meta = scheduler.build_connector_meta(prefill(req, [3, 7, 9]))
    reader, _ = make_pair(tmp_path)
    worker.bind_connector_metadata(meta)
    first_layer = kv_spec().layer_names[0]
    worker.save_kv_layer(first_layer, worker.kv_caches[first_layer], None)
    assert reader.get_num_new_matched_tokens(req, 0) == (0, False)
    for name in kv_spec().layer_names[1:]:
        worker.save_kv_layer(name, worker.kv_caches[name], None)
    worker.wait_for_save()
    assert reader.get_num_new_matched_tokens(req, 0) == (8, False)


@pytest.mark.parametrize("damage", ["garbage", "truncate", "delete"])
def test_damaged_entry_reports_invalid_blocks_and_is_removed(tmp_path, damage):
    save_prompt(tmp_path)
    (entry,) = list(tmp_path.iterdir())
    victim = entry / f"{kv_spec().layer_names[1]}.safetensors"
    if damage == "garbage":
        victim.write_bytes(b"\x07not a safetensors file" * 10)
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:200])
    else:
        victim.unlink()
    matched, _, output, worker, scheduler = load_into(tmp_path, block_ids=[5, 2, 11])
    assert matched == (8, False)
    assert output.invalid_block_ids == {5, 2}
    assert all(not cache.any() for cache in worker.kv_caches.values()), "no partial KV is written"
    assert scheduler.take_stats()["load_failures"] == 1
    assert not entry.exists()
    assert scheduler.get_num_new_matched_tokens(request(PROMPT), 0) == (0, False)


def test_entry_of_another_model_is_not_matched(tmp_path):
    save_prompt(tmp_path)
    other, _ = make_pair(tmp_path, spec=kv_spec(fingerprint={"architecture": "qwen2"}))
    assert other.get_num_new_matched_tokens(request(PROMPT), 0) == (0, False)


def test_shared_storage_path_is_required(tmp_path):
    config = engine_config({"kv_connector": "ExampleConnector"})
    with pytest.raises(ValueError, match="shared_storage_path"):
        ExampleConnector(config, KVConnectorRole.SCHEDULER, kv_spec())

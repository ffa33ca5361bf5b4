import pytest

from kvrelay.kv_transfer import KVOutputAggregator
from kvrelay.outputs import KVConnectorOutput as Out


def test_single_worker_passes_everything_through():
    agg = KVOutputAggregator(1)
    merged = agg.aggregate([Out(finished_sending={"a"}, finished_recving={"b"}, failed_recving={"c"},
                                invalid_block_ids={7}, stats={"bytes_loaded": 10})])
    assert (merged.finished_sending, merged.finished_recving, merged.failed_recving) == ({"a"}, {"b"}, {"c"})
    assert merged.invalid_block_ids == {7} and merged.stats == {"bytes_loaded": 10}
    assert agg.num_pending() == 0


def test_request_is_finished_only_once_both_workers_reported_it_across_steps():
    agg = KVOutputAggregator(2)
    step1 = agg.aggregate([Out(finished_sending={"s"}, finished_recving={"r"}), Out()])
    assert not step1.finished_sending and not step1.finished_recving
    step2 = agg.aggregate([None, Out(finished_sending={"s"})])
    assert step2.finished_sending == {"s"} and not step2.finished_recving
    step3 = agg.aggregate([Out(), Out(finished_recving={"r"})])
    assert step3.finished_recving == {"r"} and not step3.finished_sending
    assert agg.num_pending() == 0


def test_same_step_reports_from_both_workers_finish_at_once():
    agg = KVOutputAggregator(2)
    merged = agg.aggregate([Out(finished_recving={"a", "b"}), Out(finished_recving={"a"})])
    assert merged.finished_recving == {"a"}
    assert agg.aggregate([Out(), Out(finished_recving={"b"})]).finished_recving == {"b"}


def test_invalid_blocks_are_unioned_and_stats_summed_at_once():
    agg = KVOutputAggregator(2)
    merged = agg.aggregate([Out(invalid_block_ids={1, 2}, stats={"bytes_loaded": 5, "tokens_loaded": 4}),
                            Out(invalid_block_ids={2, 3}, stats={"bytes_loaded": 7})])
    assert merged.invalid_block_ids == {1, 2, 3}
    assert merged.stats == {"bytes_loaded": 12, "tokens_loaded": 4}


def test_failed_receive_settles_when_every_worker_settled_and_reads_as_failed():
    # Worker 1 may still be writing into the blocks when worker 0 fails: the scheduler must not
    # reuse them before worker 1 settles too.
    agg = KVOutputAggregator(2)
    step1 = agg.aggregate([Out(failed_recving={"r"}), Out()])
    assert not step1.failed_recving and not step1.finished_recving
    step2 = agg.aggregate([Out(), Out(finished_recving={"r"})])
    assert step2.failed_recving == {"r"} and not step2.finished_recving
    both = agg.aggregate([Out(failed_recving={"x"}), Out(failed_recving={"x"})])
    assert both.failed_recving == {"x"}
    assert agg.num_pending() == 0


def test_wrong_number_of_outputs_is_rejected():
    with pytest.raises(ValueError, match="expected 2 worker outputs, got 1"):
        KVOutputAggregator(2).aggregate([Out()])
    with pytest.raises(ValueError, match="world_size"):
        KVOutputAggregator(0)

"""The runner's request table: the scheduler's diffs applied, and a step's inputs out of it."""

from __future__ import annotations

import pytest
import torch

from kvrelay.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvrelay.sampling_params import SamplingParams
from kvrelay.worker.requests import RequestTable

BS = 4
CPU = torch.device("cpu")


def new(req_id: str, prompt: list[int], blocks: list[int], computed: int = 0) -> NewRequestData:
    return NewRequestData(req_id, prompt, [], SamplingParams(), blocks, computed)


def test_a_step_of_new_and_running_requests_in_the_schedulers_order() -> None:
    table = RequestTable(BS, max_blocks_per_request=8, eos_token_ids=(2,), device=CPU, capacity=2)
    table.update(SchedulerOutput(scheduled_new_reqs=[new("a", [10, 11, 12, 13, 14], [7, 3]),
                                                     new("b", list(range(20, 29)), [5, 6, 9], computed=4)]))
    batch, input_ids = table.step_inputs(["b", "a"], {"b": 5, "a": 5})
    assert input_ids.tolist() == [24, 25, 26, 27, 28, 10, 11, 12, 13, 14]
    assert batch.query_lens.tolist() == [5, 5] and batch.seq_lens.tolist() == [9, 5]
    assert batch.slot_mapping.tolist() == [6 * BS, 6 * BS + 1, 6 * BS + 2, 6 * BS + 3, 9 * BS,
                                           7 * BS, 7 * BS + 1, 7 * BS + 2, 7 * BS + 3, 3 * BS]

    # "a" decodes its sampled token into a new block, "b" finished; a third request takes b's row
    table.update(SchedulerOutput(scheduled_cached_reqs=[CachedRequestData("a", [4], 5, [15])],
                                 finished_req_ids={"b"}))
    table.update(SchedulerOutput(scheduled_new_reqs=[new("c", [30], [8])]))
    assert "b" not in table and table["c"].row == 1
    batch, input_ids = table.step_inputs(["a", "c"], {"a": 1, "c": 1})
    assert input_ids.tolist() == [15, 30] and batch.is_decode_only
    assert batch.positions.tolist() == [5, 0] and batch.slot_mapping.tolist() == [3 * BS + 1, 8 * BS]


def test_the_table_grows_past_its_capacity_and_refuses_more_blocks_than_a_row_holds() -> None:
    table = RequestTable(BS, max_blocks_per_request=2, eos_token_ids=(), device=CPU, capacity=1)
    table.update(SchedulerOutput(scheduled_new_reqs=[new("a", [1], [0]), new("b", [2], [1])]))
    assert {table["a"].row, table["b"].row} == {0, 1}
    with pytest.raises(ValueError, match="holds 3 blocks, more than the 2 that max_model_len allows"):
        table.update(SchedulerOutput(scheduled_cached_reqs=[CachedRequestData("a", [4, 5], 1, [])]))

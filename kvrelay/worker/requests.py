"""The model runner's view of its requests: what the scheduler sent, kept as a diff.

Each live request holds a row of one block table kept in numpy (its block ids, appended as the
scheduler hands out blocks), its known token ids and how many of them are computed. A step's
inputs then come from one pass over the scheduled requests (their rows, lengths and token ids)
and indexing: their rows give the step's block tables, and their slots and positions come out of
`StepBatch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvrelay.attention.metadata import StepBatch
from kvrelay.core.sched_output import SchedulerOutput
from kvrelay.model.sampler import SamplingRow, make_generator, needs_token_history
from kvrelay.sampling_params import SamplingParams


@dataclass
class RequestState:
    req_id: str
    row: int  # its row of the block table
    token_ids: list[int]  # prompt + output tokens known to the runner
    num_prompt_tokens: int
    num_computed_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def sampling_row(self) -> SamplingRow:
        """What the sampler needs; the token history only when the params read it (penalties,
        min_tokens), so a plain step copies no request's token list."""
        params, prompt_len = self.sampling_params, self.num_prompt_tokens
        history = needs_token_history(params)
        return SamplingRow(params=params, prompt_token_ids=self.token_ids[:prompt_len] if history else [],
                           output_token_ids=self.token_ids[prompt_len:] if history else [],
                           eos_token_ids=self.eos_token_ids, generator=self.generator)


class RequestTable:
    def __init__(self, block_size: int, max_blocks_per_request: int, eos_token_ids: tuple[int, ...],
                 device: torch.device, capacity: int = 64) -> None:
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.requests: dict[str, RequestState] = {}
        self.block_table = np.zeros((capacity, max_blocks_per_request), dtype=np.int32)  # [rows, W]
        self.num_blocks = np.zeros(capacity, dtype=np.int32)  # [rows]
        self._free_rows = list(range(capacity - 1, -1, -1))

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.requests

    def __getitem__(self, req_id: str) -> RequestState:
        return self.requests[req_id]

    def update(self, sched_out: SchedulerOutput) -> None:
        """Apply the scheduler's diff: finished requests leave, new (or resumed) ones arrive,
        running ones get their new tokens and blocks."""
        for req_id in sched_out.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self._free_rows.append(state.row)
        for new in sched_out.scheduled_new_reqs:
            previous = self.requests.get(new.req_id)  # a resumed request keeps its generator and row
            params = new.sampling_params
            generator = previous.generator if previous is not None else (
                make_generator(params.seed) if params.seed is not None else None)
            row = previous.row if previous is not None else self._take_row()
            self.requests[new.req_id] = RequestState(
                req_id=new.req_id, row=row, token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids), num_computed_tokens=new.num_computed_tokens,
                sampling_params=params, generator=generator, eos_token_ids=self.eos_token_ids)
            self.num_blocks[row] = 0
            self._append_blocks(row, new.block_ids)
        for cached in sched_out.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            self._append_blocks(state.row, cached.new_block_ids)

    def step_inputs(self, req_ids: list[str], num_scheduled: dict[str, int]) -> tuple[StepBatch, np.ndarray]:
        """The step of `req_ids` (in this order), and its input token ids [T] int64."""
        rows, query_lens, seq_lens, input_ids = [], [], [], []
        for req_id in req_ids:  # one pass over the requests; the rest is array arithmetic
            state = self.requests[req_id]
            start, n = state.num_computed_tokens, num_scheduled[req_id]
            rows.append(state.row)
            query_lens.append(n)
            seq_lens.append(start + n)
            if n == 1:
                input_ids.append(state.token_ids[start])
            else:
                input_ids.extend(state.token_ids[start:start + n])
        row_index = np.array(rows, dtype=np.int64)  # [S]
        width = max(1, (max(seq_lens, default=0) + self.block_size - 1) // self.block_size)
        batch = StepBatch(query_lens=np.array(query_lens, dtype=np.int32),
                          seq_lens=np.array(seq_lens, dtype=np.int32),
                          block_tables=self.block_table[row_index, :width],
                          num_blocks=self.num_blocks[row_index], block_size=self.block_size,
                          device=self.device)
        return batch, np.array(input_ids, dtype=np.int64)  # [T]

    def _take_row(self) -> int:
        if not self._free_rows:  # more live requests than rows (preempted ones keep theirs): grow
            capacity = len(self.num_blocks)
            self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
            self._free_rows = list(range(2 * capacity - 1, capacity - 1, -1))
        return self._free_rows.pop()

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            raise ValueError(f"a request holds {end} blocks, more than the {self.block_table.shape[1]} that "
                             "max_model_len allows")
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

"""SchedulerOutput: the per-step diff that the scheduler hands to the model runner.

New requests travel in full once; requests the runner already knows travel as a diff. The
connector's per-step metadata rides along in `kv_connector_metadata`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# NOTE: a runtime import (not TYPE_CHECKING only): the executor decodes SchedulerOutput by its
# type hints in worker processes.
from kvrelay.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    # Output tokens so far: non-empty when a preempted request is resumed from scratch.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]  # blocks appended since the last step
    num_computed_tokens: int
    new_token_ids: list[int]  # output tokens the runner has not seen yet


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # req_id -> tokens to compute this step, in batch order (new requests after cached ones).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests that left since the last step: the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: Any = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

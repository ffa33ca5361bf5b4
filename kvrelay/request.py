"""Request: one generation request as the scheduler sees it, and its lifecycle states."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrelay.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # NOTE: every status after PREEMPTED is a finished one (see is_finished).
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    kv_transfer_params: dict[str, Any] | None = None
    priority: int = 0

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)  # prompt + output, kept in sync
    num_computed_tokens: int = 0
    # At the first admission: the local prefix hit (-1 before it) and the tokens the connector
    # offered on top of it. vLLM's PrefillStats count the same two.
    num_local_cached_tokens: int = -1
    num_external_cached_tokens: int = 0
    # D of a P/D pair: P's own cache hit on this prompt, from P's kv_transfer_params (vLLM's
    # remote_prefill_cached_tokens); the usage reports it instead of the transfer D loaded.
    remote_prefill_cached_tokens: int | None = None
    # Tokens that arrived from outside (loads that settled), for the stats.
    num_external_tokens: int = 0
    # External tokens loaded synchronously whose step has not been confirmed yet (for stats).
    num_external_unconfirmed: int = 0
    num_preemptions: int = 0
    # Chained hashes of the full blocks of all_token_ids, extended by the KV cache manager.
    block_hashes: list[bytes] = field(default_factory=list)
    # Why the request stopped: a stop token id or stop string, when that is the reason.
    stop_reason: int | str | None = None
    error: str | None = None
    # Set when a connector keeps this request's blocks after it finished (delay_free).
    blocks_held_by_connector: bool = False

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        params = self.kv_transfer_params or {}
        cached = params.get("remote_prefill_cached_tokens")
        if params.get("do_remote_prefill") and isinstance(cached, int) and not isinstance(cached, bool):
            self.remote_prefill_cached_tokens = cached

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens this request did not compute, as vLLM reports them (usage's
        prompt_tokens_details.cached_tokens): the local prefix hit plus the tokens a connector
        offered at the first admission (an offload hit, a P/D load), or P's own hit when P
        computed the prompt and said so."""
        if self.remote_prefill_cached_tokens is not None:
            return self.remote_prefill_cached_tokens
        return max(self.num_local_cached_tokens, 0) + self.num_external_cached_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        ids = [token_ids] if isinstance(token_ids, int) else token_ids
        self.output_token_ids.extend(ids)
        self.all_token_ids.extend(ids)

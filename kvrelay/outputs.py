"""What flows back up: sampler results, runner results, connector results, user-facing outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TokenLogprobs:
    """Log-probabilities for one sampled position.

    token_ids[0] is the sampled token; token_ids[1:] are the top-n tokens, most likely first.
    logprobs are aligned with token_ids. sampled_rank is the 1-based rank of the sampled token.
    """

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


@dataclass
class KVConnectorOutput:
    """Worker-side connector results for one step (see docs/architecture.md, "The KV connector contract")."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    stats: dict[str, Any] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving
                    or self.invalid_block_ids or self.stats)


@dataclass
class ModelRunnerOutput:
    """One step's results, aligned with the scheduled request order."""

    req_ids: list[str]
    # One list per request: the sampled token(s), or empty when the request only advanced
    # its prefill (a chunk that did not reach the end of the prompt).
    sampled_token_ids: list[list[int]]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    kv_connector_output: KVConnectorOutput | None = None

    @classmethod
    def empty(cls, kv_connector_output: KVConnectorOutput | None = None) -> ModelRunnerOutput:
        return cls(req_ids=[], sampled_token_ids=[], logprobs=[], kv_connector_output=kv_connector_output)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # One dict per generated token: token id -> Logprob (sampled token and the top-n).
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    # What this output adds to the previous one of the same request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    kv_transfer_params: dict[str, Any] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """What the scheduler reports for one request after a step (before detokenization)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

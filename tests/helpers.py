"""Shared builders for tests: configs, requests, a deterministic fake model runner."""

from __future__ import annotations

import itertools
from typing import Any

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.core.sched_output import SchedulerOutput
from kvrelay.core.scheduler import Scheduler
from kvrelay.outputs import KVConnectorOutput, ModelRunnerOutput
from kvrelay.request import Request
from kvrelay.sampling_params import SamplingParams

EOS = 0
VOCAB = 1000
_ids = itertools.count()


def make_config(block_size: int = 4, max_num_seqs: int = 16, max_num_batched_tokens: int = 64,
                long_prefill_token_threshold: int = 0, enable_prefix_caching: bool = True,
                kv_transfer: Any = None) -> EngineConfig:
    return EngineConfig(
        cache=CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  long_prefill_token_threshold=long_prefill_token_threshold),
        kv_transfer=kv_transfer)


def make_scheduler(num_blocks: int = 64, max_model_len: int = 256, connector: Any = None,
                   **config_kwargs: Any) -> Scheduler:
    return Scheduler(make_config(**config_kwargs), num_blocks, max_model_len, connector)


def make_request(prompt: list[int] | int, max_tokens: int = 4, request_id: str | None = None,
                 ignore_eos: bool = True, kv_transfer_params: dict[str, Any] | None = None,
                 **params: Any) -> Request:
    if isinstance(prompt, int):
        prompt = [1 + (i * 7) % (VOCAB - 1) for i in range(prompt)]
    return Request(request_id=request_id or f"r{next(_ids)}", prompt_token_ids=list(prompt),
                   sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **params),
                   eos_token_ids=(EOS,), kv_transfer_params=kv_transfer_params)


def next_token(token_ids: list[int]) -> int:
    """The fake model: the next token is a fixed function of the whole sequence so far."""
    return 1 + (sum(t * (i + 1) for i, t in enumerate(token_ids)) % (VOCAB - 1))


class FakeRunner:
    """Plays the model runner from the scheduler's diffs: keeps per-request token/block state
    exactly like the real runner and 'samples' next_token(sequence) when a request reaches its
    last known token. Records which KV positions were computed into which block."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.state: dict[str, dict[str, Any]] = {}
        self.kv_out: list[KVConnectorOutput] = []  # queued connector outputs, one per step
        self.computed_tokens_per_step: list[int] = []

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.state.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.state[new.req_id] = {"tokens": list(new.prompt_token_ids) + list(new.output_token_ids),
                                      "blocks": list(new.block_ids), "computed": new.num_computed_tokens}
        for c in so.scheduled_cached_reqs:
            st = self.state[c.req_id]
            st["tokens"].extend(c.new_token_ids)
            st["blocks"].extend(c.new_block_ids)
            st["computed"] = c.num_computed_tokens
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            st = self.state[rid]
            end = st["computed"] + n
            assert end <= len(st["tokens"]), "scheduled past the known tokens"
            assert len(st["blocks"]) * self.block_size >= end, "not enough blocks for the scheduled tokens"
            req_ids.append(rid)
            sampled.append([next_token(st["tokens"])] if end == len(st["tokens"]) else [])
        self.computed_tokens_per_step.append(so.total_num_scheduled_tokens)
        kv = self.kv_out.pop(0) if self.kv_out else None
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                                 logprobs=[None] * len(req_ids), kv_connector_output=kv)


def run_to_completion(sched: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> dict[str, list[int]]:
    """Step until idle; returns each request's output tokens."""
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_pending_work():
            return tokens
        so = sched.schedule()
        for out in sched.update_from_output(so, runner.execute(so)):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError(f"not idle after {max_steps} steps")


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt):]

"""Turn per-step token ids into user-facing outputs: incremental text, stop strings, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from tokenizers.decoders import DecodeStream

from kvrelay.model.tokenizer import Tokenizer
from kvrelay.outputs import CompletionOutput, EngineCoreOutput, Logprob, RequestOutput, TokenLogprobs
from kvrelay.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text, one delta at a time.

    Byte-level BPE tokens can split a UTF-8 character, so the text of the newest tokens is
    released only once it decodes cleanly, and merges across the boundary (leading spaces) must
    come out as a decode of the whole list would. The tokenizers library's `DecodeStream` does
    exactly that in one call per token (a third of the two decodes per token of re-decoding a
    window, measured on SmolLM2's tokenizer).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def append(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        backend = self.tokenizer.backend
        return "".join(self._stream.step(backend, token_id) or "" for token_id in token_ids)


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    text: str = ""
    sent_text_len: int = 0  # characters already handed out as deltas
    token_ids: list[int] = field(default_factory=list)
    sent_token_len: int = 0
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        self.states[request_id] = _RequestState(
            request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids, params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None)

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], dict[str, str]]:
        """Returns the outputs, and the requests that hit a stop string (id -> the string),
        which the caller must finish in the scheduler."""
        outputs: list[RequestOutput] = []
        stopped: dict[str, str] = {}
        for core in core_outputs:
            state = self.states.get(core.request_id)
            if state is None:
                continue
            stop = self._append(state, core)
            finish_reason, stop_reason = core.finish_reason, core.stop_reason
            if stop is not None and finish_reason is None:
                stopped[core.request_id] = stop
                finish_reason, stop_reason = "stop", stop
            outputs.append(self._make_output(state, core, finish_reason, stop_reason))
            if finish_reason is not None:
                del self.states[core.request_id]
        return outputs, stopped

    def abort(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def _append(self, state: _RequestState, core: EngineCoreOutput) -> str | None:
        if not core.new_token_ids:
            return None
        state.token_ids.extend(core.new_token_ids)
        if state.logprobs is not None:
            for lp in core.new_logprobs:
                state.logprobs.append(self._logprob_dict(lp))
                state.cumulative_logprob = (state.cumulative_logprob or 0.0) + lp.logprobs[0]
        delta = state.detokenizer.append(core.new_token_ids)
        if not delta:
            return None
        start = max(0, len(state.text) - max((len(s) for s in _stops(state)), default=0) + 1)
        state.text += delta
        return self._find_stop(state, start)

    def _find_stop(self, state: _RequestState, search_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in _stops(state):
            idx = state.text.find(stop, search_from)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        state.text = state.text[: idx + len(stop)] if state.params.include_stop_str_in_output \
            else state.text[:idx]
        return stop

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        out: dict[int, Logprob] = {}
        for i, (tok, val) in enumerate(zip(lp.token_ids, lp.logprobs, strict=True)):
            if tok in out:
                continue
            rank = lp.sampled_rank if i == 0 else i
            out[tok] = Logprob(logprob=val, rank=rank, decoded_token=self.tokenizer.decode([tok],
                               skip_special_tokens=False))
        return out

    def _make_output(self, state: _RequestState, core: EngineCoreOutput, finish_reason: str | None,
                     stop_reason: Any) -> RequestOutput:
        finished = finish_reason is not None
        # While streaming, hold back text that could still become the start of a stop string.
        hold = 0 if finished else max((len(s) for s in _stops(state)), default=1) - 1
        visible = len(state.text) - hold if hold else len(state.text)
        visible = max(visible, state.sent_text_len)
        delta_text = state.text[state.sent_text_len:visible]
        state.sent_text_len = visible
        delta_ids = state.token_ids[state.sent_token_len:]
        state.sent_token_len = len(state.token_ids)
        completion = CompletionOutput(
            index=0, text=state.text if finished else state.text[:visible],
            token_ids=list(state.token_ids), cumulative_logprob=state.cumulative_logprob,
            logprobs=state.logprobs, finish_reason=finish_reason, stop_reason=stop_reason,
            delta_text=delta_text, delta_token_ids=delta_ids)
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            outputs=[completion], finished=finished, kv_transfer_params=core.kv_transfer_params,
            num_cached_tokens=core.num_cached_tokens, error=core.error)


def _stops(state: _RequestState) -> list[str]:
    """The request's stop strings: SamplingParams made `stop` a list on construction."""
    return cast(list[str], state.params.stop)

"""RequestOutput -> OpenAI JSON: completion and chat bodies, stream chunks, logprobs, usage."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from kvrelay.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class ResponseContext:
    """What every body and chunk of one response shares. A response answers one or more prompts
    (a list in /v1/completions), each with n choices: choice j of prompt k has index k * n + j."""

    kind: str  # "completion" | "chat"
    model: str
    top_logprobs: int | None  # None: no logprobs were asked for
    include_usage: bool = False
    continuous_usage: bool = False  # usage so far in every streamed chunk (vLLM's option)
    n: int = 1
    echo_texts: list[str] = field(default_factory=list)  # per prompt: text prepended to its choices
    echo_only: bool = False  # echo with max_tokens=0: the generated token is dropped
    request_id: str | None = None  # the response id for several prompts (one engine id each)
    created: int = field(default_factory=lambda: int(time.time()))

    def response_id(self, out: RequestOutput) -> str:
        return f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{self.request_id or out.request_id}"

    def echo_text(self, prompt_index: int) -> str:
        return self.echo_texts[prompt_index] if prompt_index < len(self.echo_texts) else ""


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def usage(ctx: ResponseContext, outs: list[RequestOutput]) -> dict[str, Any]:
    """OpenAI's counting: each prompt once, every choice's tokens."""
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outs)
    completion_tokens = 0 if ctx.echo_only else sum(len(c.token_ids) for out in outs for c in out.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(out.num_cached_tokens for out in outs)}}


def full_response(ctx: ResponseContext, finals: list[RequestOutput]) -> dict[str, Any]:
    """The non-streamed body, one final output per prompt. `kv_transfer_params` is top level, as
    vLLM's P/D proxies expect (a single prompt only: several would need one each)."""
    choices = []
    for k, out in enumerate(finals):
        for completion in out.outputs:
            text = ctx.echo_text(k) + ("" if ctx.echo_only else completion.text)
            lps = _logprobs(ctx, completion, completion.logprobs or [], text_start=0)
            choice: dict[str, Any] = {"index": k * ctx.n + completion.index}
            if ctx.kind == "chat":
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice.update(logprobs=lps, finish_reason=completion.finish_reason,
                          stop_reason=completion.stop_reason)
            choices.append(choice)
    obj = "chat.completion" if ctx.kind == "chat" else "text_completion"
    return {"id": ctx.response_id(finals[0]), "object": obj, "created": ctx.created, "model": ctx.model,
            "choices": choices, "usage": usage(ctx, finals),
            "kv_transfer_params": finals[0].kv_transfer_params if len(finals) == 1 else None}


@dataclass
class _ChoiceStream:
    sent_role: bool = False
    echoed: bool = False
    finished: bool = False
    text_offset: int = 0


class ChunkWriter:
    """Turns the successive outputs of a response's prompts into SSE events; the choices of all
    prompts interleave as their tokens arrive, each chunk naming its choice's index."""

    def __init__(self, ctx: ResponseContext) -> None:
        self.ctx = ctx
        self.choices: dict[int, _ChoiceStream] = {}
        self.latest: dict[int, RequestOutput] = {}  # per prompt, for usage

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[str]:
        self.latest[prompt_index] = out
        events: list[dict[str, Any]] = []
        for completion in out.outputs:
            index = prompt_index * self.ctx.n + completion.index
            state = self.choices.setdefault(index, _ChoiceStream())
            if not state.finished:
                events.extend(self._choice_chunks(out, index, prompt_index, completion, state))
        if out.finished and out.kv_transfer_params is not None and events:
            events[-1]["kv_transfer_params"] = out.kv_transfer_params
        return [sse(e) for e in events]

    def usage_chunk(self) -> str | None:
        """The last chunk when usage was asked for: no choices, the whole response's usage."""
        if not self.ctx.include_usage or not self.latest:
            return None
        return sse(self._chunk(next(iter(self.latest.values())), None) | {"usage": self._usage()})

    def _choice_chunks(self, out: RequestOutput, index: int, prompt_index: int, completion: CompletionOutput,
                       state: _ChoiceStream) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        echo = "" if state.echoed else self.ctx.echo_text(prompt_index)
        state.echoed = True
        if self.ctx.kind == "chat" and not state.sent_role:
            state.sent_role = True
            events.append(self._chunk(out, {"index": index, "delta": {"role": "assistant", "content": echo},
                                            "logprobs": None, "finish_reason": None}))
            echo = ""
        new_ids = completion.delta_token_ids
        new_logprobs = (completion.logprobs or [])[-len(new_ids):] if new_ids else []
        wants_logprobs = self.ctx.top_logprobs is not None and bool(new_logprobs)
        text = echo + ("" if self.ctx.echo_only else completion.delta_text)
        finished = completion.finish_reason is not None
        if text or finished or wants_logprobs:
            lps = _logprobs(self.ctx, completion, new_logprobs, state.text_offset)
            state.text_offset += len(text)
            choice: dict[str, Any] = {"index": index}
            if self.ctx.kind == "chat":
                choice["delta"] = {"content": text} if text else {}
            else:
                choice["text"] = text
            choice.update(logprobs=lps, finish_reason=completion.finish_reason)
            if finished:
                choice["stop_reason"] = completion.stop_reason
                state.finished = True
            events.append(self._chunk(out, choice))
        return events

    def _usage(self) -> dict[str, Any]:
        return usage(self.ctx, [self.latest[k] for k in sorted(self.latest)])

    def _chunk(self, out: RequestOutput, choice: dict[str, Any] | None) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.ctx.kind == "chat" else "text_completion"
        body: dict[str, Any] = {"id": self.ctx.response_id(out), "object": obj, "created": self.ctx.created,
                                "model": self.ctx.model, "choices": [] if choice is None else [choice]}
        if self.ctx.include_usage:
            body["usage"] = self._usage() if self.ctx.continuous_usage and choice is not None else None
        return body


def _logprobs(ctx: ResponseContext, completion: CompletionOutput, entries: list[dict[int, Logprob]],
              text_start: int) -> dict[str, Any] | None:
    if ctx.top_logprobs is None:
        return None
    token_ids = completion.token_ids[len(completion.token_ids) - len(entries):]
    if ctx.kind == "chat":
        return {"content": [_chat_token(tok, entry, ctx.top_logprobs)
                            for tok, entry in zip(token_ids, entries, strict=True)]}
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_start
    for tok, entry in zip(token_ids, entries, strict=True):
        sampled = entry[tok]
        text = sampled.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(sampled.logprob)
        top.append({lp.decoded_token or "": lp.logprob for lp in _top(entry, ctx.top_logprobs)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_token(token_id: int, entry: dict[int, Logprob], n: int) -> dict[str, Any]:
    sampled = entry[token_id]
    return {**_chat_logprob(sampled), "top_logprobs": [_chat_logprob(lp) for lp in _top(entry, n)]}


def _chat_logprob(lp: Logprob) -> dict[str, Any]:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}


def _top(entry: dict[int, Logprob], n: int) -> list[Logprob]:
    """The n most likely tokens at one position (the sampled one is included only if it ranks)."""
    ranked = [lp for lp in entry.values() if lp.rank is not None and lp.rank <= n]
    return sorted(ranked, key=lambda lp: lp.rank or 0)

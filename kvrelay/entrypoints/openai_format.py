"""RequestOutput -> OpenAI JSON: completion and chat bodies, stream chunks, logprobs, usage."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from kvrelay.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class ResponseContext:
    """What every body and chunk of one response shares."""

    kind: str  # "completion" | "chat"
    model: str
    top_logprobs: int | None  # None: no logprobs were asked for
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def response_id(self, out: RequestOutput) -> str:
        return f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{out.request_id}"


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def usage(out: RequestOutput) -> dict[str, Any]:
    prompt_tokens = len(out.prompt_token_ids)
    completion_tokens = len(out.outputs[0].token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def full_response(ctx: ResponseContext, out: RequestOutput) -> dict[str, Any]:
    """The non-streamed body. `kv_transfer_params` is top level, as vLLM's P/D proxies expect."""
    completion = out.outputs[0]
    lps = _logprobs(ctx, completion, completion.logprobs or [], text_start=0)
    if ctx.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": completion.text},
                  "logprobs": lps, "finish_reason": completion.finish_reason,
                  "stop_reason": completion.stop_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": completion.text, "logprobs": lps,
                  "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}
        obj = "text_completion"
    return {"id": ctx.response_id(out), "object": obj, "created": ctx.created, "model": ctx.model,
            "choices": [choice], "usage": usage(out), "kv_transfer_params": out.kv_transfer_params}


class ChunkWriter:
    """Turns a request's successive outputs into SSE events (ending with `data: [DONE]`)."""

    def __init__(self, ctx: ResponseContext) -> None:
        self.ctx = ctx
        self.sent_role = False
        self.text_offset = 0

    def chunks(self, out: RequestOutput) -> list[str]:
        completion = out.outputs[0]
        events: list[dict[str, Any]] = []
        if self.ctx.kind == "chat" and not self.sent_role:
            self.sent_role = True
            events.append(self._chunk(out, {"delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                            "finish_reason": None}))
        new_logprobs = (completion.logprobs or [])[-len(completion.delta_token_ids):] \
            if completion.delta_token_ids else []
        wants_logprobs = self.ctx.top_logprobs is not None and bool(new_logprobs)
        if completion.delta_text or out.finished or wants_logprobs:
            lps = _logprobs(self.ctx, completion, new_logprobs, self.text_offset)
            self.text_offset += len(completion.delta_text)
            if self.ctx.kind == "chat":
                delta = {"content": completion.delta_text} if completion.delta_text else {}
                choice: dict[str, Any] = {"delta": delta}
            else:
                choice = {"text": completion.delta_text}
            choice.update(logprobs=lps, finish_reason=completion.finish_reason)
            if out.finished:
                choice["stop_reason"] = completion.stop_reason
            chunk = self._chunk(out, choice)
            if out.finished and out.kv_transfer_params is not None:
                chunk["kv_transfer_params"] = out.kv_transfer_params
            events.append(chunk)
        if out.finished and self.ctx.include_usage:
            events.append(self._chunk(out, None) | {"usage": usage(out)})
        return [sse(e) for e in events]

    def _chunk(self, out: RequestOutput, choice: dict[str, Any] | None) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.ctx.kind == "chat" else "text_completion"
        choices = [] if choice is None else [{"index": 0, **choice}]
        body: dict[str, Any] = {"id": self.ctx.response_id(out), "object": obj, "created": self.ctx.created,
                                "model": self.ctx.model, "choices": choices}
        if self.ctx.include_usage:
            body["usage"] = None
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

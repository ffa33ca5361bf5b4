"""When P's single token already ends the answer, the proxy answers from P's result.

P's leg asks for one token. If that token ends the request (the model's end of sequence, or a
stop string: `finish_reason` "stop"), the client's own request would end there too, and a
decode leg would only recompute the whole prompt to reach the same end (P keeps no KV for a
request that did not stop on its length, so D could not load it). The proxy then answers with
P's body, streamed as `kvrelay serve` streams it when the client asked for a stream.

Not for requests whose answer could differ: several choices (n, best_of), min_tokens above one
(P's leg drops it), echo (the stream splits the echoed text) or continuous usage stats.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any


def can_answer_from_prefill(body: dict[str, Any], answer: dict[str, Any]) -> bool:
    """Whether P's `answer` to the prefill leg of `body` is the client's final answer."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    if choices[0].get("finish_reason") != "stop":
        return False
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return False
    if (body.get("min_tokens") or 0) > 1 or body.get("echo"):
        return False
    options = body.get("stream_options")
    return not (isinstance(options, dict) and options.get("continuous_usage_stats"))


def streamed(route: str, body: dict[str, Any], answer: dict[str, Any]) -> Iterator[bytes]:
    """P's non-streamed `answer` as the SSE stream `kvrelay serve` sends for it."""
    for event in stream_events(route, body, answer):
        yield _sse(event)
    yield b"data: [DONE]\n\n"


def stream_events(route: str, body: dict[str, Any], answer: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The chunks of that stream, before the closing [DONE]."""
    chat = route.endswith("/chat/completions")
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    base = {"id": answer.get("id"), "object": "chat.completion.chunk" if chat else "text_completion",
            "created": answer.get("created"), "model": answer.get("model")}
    usage_field = {"usage": None} if include_usage else {}
    choice = answer["choices"][0]
    last: dict[str, Any] = {"index": choice.get("index", 0)}
    if chat:
        role = {"index": last["index"], "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}
        yield {**base, "choices": [role], **usage_field}
        text = (choice.get("message") or {}).get("content") or ""
        last["delta"] = {"content": text} if text else {}
    else:
        last["text"] = choice.get("text") or ""
    last.update(logprobs=choice.get("logprobs"), finish_reason=choice.get("finish_reason"),
                stop_reason=choice.get("stop_reason"))
    yield {**base, "choices": [last], **usage_field}
    if include_usage:
        yield {**base, "choices": [], "usage": answer.get("usage")}


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()

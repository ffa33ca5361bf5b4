"""A list of prompts through the P/D proxy: split into one request per prompt, merged back.

Each prompt of a `/v1/completions` list needs its own prefill and its own kv_transfer_params, so
the proxy sends one P leg and one D leg per prompt (concurrently) and merges the answers into the
body a single instance would have sent: choice j of prompt k gets index k * n + j, usage is
summed, a stream interleaves the legs' chunks as they arrive and ends with one usage chunk (when
asked for) and one `data: [DONE]`.
"""

from __future__ import annotations

import json
from typing import Any


def split_prompts(route: str, body: dict[str, Any]) -> list[Any] | None:
    """The prompts of a completions body holding a list of two or more prompts (strings or
    token-id lists); None when the body goes through as it is."""
    prompt = body.get("prompt")
    if route != "/v1/completions" or not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return list(prompt)
    return None  # a list of token ids is one prompt; a malformed list is for D to refuse


def num_choices(body: dict[str, Any]) -> int:
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


def renumber(event: dict[str, Any], prompt_index: int, n: int, response_id: str) -> dict[str, Any]:
    """One leg's body or chunk as part of the whole response."""
    event = dict(event)
    event["choices"] = [{**c, "index": prompt_index * n + int(c.get("index", 0))}
                        for c in event.get("choices") or []]
    if "id" in event:
        event["id"] = response_id
    return event


def add_usage(total: dict[str, Any] | None, usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return total
    if total is None:
        return json.loads(json.dumps(usage))  # a deep copy
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        total[key] = int(total.get(key) or 0) + int(usage.get(key) or 0)
    details, extra = total.get("prompt_tokens_details"), usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(extra, dict):
        cached = int(details.get("cached_tokens") or 0) + int(extra.get("cached_tokens") or 0)
        details["cached_tokens"] = cached
    return total


def merge_bodies(bodies: list[dict[str, Any]], n: int, response_id: str) -> dict[str, Any]:
    """The non-streamed answers of the legs, in prompt order, as one body."""
    merged = renumber(bodies[0], 0, n, response_id)
    usage = None
    for k, body in enumerate(bodies):
        if k:
            merged["choices"].extend(renumber(body, k, n, response_id)["choices"])
        usage = add_usage(usage, body.get("usage"))
    merged["usage"] = usage
    merged["kv_transfer_params"] = None
    return merged


def parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """A decoded `data:` payload: a dict, "[DONE]", or None for other lines."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    if payload == "[DONE]":
        return payload
    try:
        event = json.loads(payload)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def is_usage_chunk(event: dict[str, Any]) -> bool:
    return not event.get("choices") and isinstance(event.get("usage"), dict)

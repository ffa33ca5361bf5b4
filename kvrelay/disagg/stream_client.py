"""A streaming OpenAI client that times every token: used by `kvrelay demo` and the benchmarks.

TTFT is the time from sending the request to the first chunk carrying text; each later text
chunk adds one inter-token latency (ITL) sample, the gap since the previous one. The server
sends one chunk per token, so chunks stand in for tokens; the exact output token count comes
from the final usage chunk (`stream_options.include_usage`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class StreamResult:
    ok: bool = False
    error: str | None = None
    text: str = ""
    ttft: float | None = None  # seconds to the first text
    itls: list[float] = field(default_factory=list)  # seconds between consecutive text chunks
    latency: float = 0.0  # seconds to the end of the stream
    output_tokens: int = 0
    prompt_tokens: int | None = None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def _chunk_text(chunk: dict[str, Any]) -> str:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if text:
            return str(text)
    return ""


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                            on_text: Callable[[str], None] | None = None) -> StreamResult:
    """POST `body` (stream forced on) to `url` (a /v1/chat/completions or /v1/completions URL)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    result, num_chunks = StreamResult(), 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if usage := chunk.get("usage"):
                    result.output_tokens = int(usage.get("completion_tokens", 0))
                    result.prompt_tokens = usage.get("prompt_tokens")
                if text := _chunk_text(chunk):
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last, num_chunks = now, num_chunks + 1
                    result.text += text
                    if on_text is not None:
                        on_text(text)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = repr(e)
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or num_chunks
    result.ok = True
    return result

"""A fake kvrelay instance for routing tests: a real prefix cache of block hashes and real KV
events over ZeroMQ (ipc://), no model. It tokenizes and hashes prompts exactly as the engine
does (the shared prompt_tokens and block_hash code), answers the prefill leg with P's usage
(cached_tokens = its prefix hit) and kv_transfer_params, and a decode leg with a few chunks."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvrelay.core.block_hash import hash_token_blocks
from kvrelay.entrypoints.prompt_tokens import request_prompt_token_ids
from kvrelay.kv_events import BlockStored, KVEventBatch, KVEventsConfig
from kvrelay.kv_events.zmq_publisher import ZmqEventPublisher
from tests.tiny import TINY_CHAT_TEMPLATE, tiny_tokenizer

BLOCK_SIZE = 4


def tokenizer() -> Any:
    tok = tiny_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


@dataclass
class FakeEngine:
    name: str
    events_dir: Path | None = None  # None: publishes no KV events (GET /kv_events says so)
    publish: bool = True  # False: events are configured but never sent (a stale index)
    delay: float = 0.0  # seconds before answering a generation request
    chunk_delay: float = 0.0
    num_chunks: int = 3
    stop_on_first_token: bool = False  # P's one token is the end of sequence
    stop_prompts: tuple[str, ...] = ()  # completion prompts whose P token ends them (the others go on)
    healthy: bool = True
    tokenizes_differently: bool = False  # its /tokenize disagrees with the proxy's tokenizer
    tail_hit_tokens: int = 0  # a hit's cached_tokens also counts this much of a partial block (a tier's tail)
    cached: set[bytes] = field(default_factory=set)
    requests: list[dict[str, Any]] = field(default_factory=list)
    answered: int = 0
    in_progress: int = 0

    def __post_init__(self) -> None:
        self.tokenizer = tokenizer()
        self.publisher: ZmqEventPublisher | None = None
        if self.events_dir is not None:
            self.config = KVEventsConfig(enable_kv_cache_events=True,
                                         endpoint=f"ipc://{self.events_dir}/{self.name}-pub",
                                         replay_endpoint=f"ipc://{self.events_dir}/{self.name}-replay")
            self.publisher = ZmqEventPublisher(self.config)
        self._lock = threading.Lock()

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.shutdown()

    def store(self, token_ids: list[int]) -> int:
        """Cache the prompt's full blocks (publishing the new ones); returns the prefix hit."""
        hashes = hash_token_blocks(token_ids, BLOCK_SIZE)
        hit = 0
        for h in hashes[:max(0, len(token_ids) - 1) // BLOCK_SIZE]:
            if h not in self.cached:
                break
            hit += 1
        new = [i for i, h in enumerate(hashes) if h not in self.cached]
        self.cached.update(hashes)
        if new and self.publisher is not None and self.publish:
            first = new[0]
            self.publisher.publish(KVEventBatch(ts=0.0, events=[BlockStored(
                block_hashes=hashes[first:], parent_block_hash=hashes[first - 1] if first else None,
                token_ids=token_ids[first * BLOCK_SIZE:len(hashes) * BLOCK_SIZE], block_size=BLOCK_SIZE,
                lora_id=None, medium="GPU", lora_name=None)]))
        return hit * BLOCK_SIZE

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._generate(await request.json(), "/v1/chat/completions")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._generate(await request.json(), "/v1/completions")

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.healthy else 503)

        @app.post("/tokenize")
        async def tokenize(request: Request) -> dict[str, Any]:
            body = await request.json()
            route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            tokens = request_prompt_token_ids(self.tokenizer, route, body) or []
            return {"tokens": [t + 1 for t in tokens] if self.tokenizes_differently else tokens}

        @app.get("/kv_events")
        async def kv_events() -> dict[str, Any]:
            if self.publisher is None:
                return {"enabled": False}
            return {"enabled": True, "endpoint": self.config.endpoint,
                    "replay_endpoint": self.config.replay_endpoint, "topic": "", "block_size": BLOCK_SIZE}

        return app

    async def _generate(self, body: dict[str, Any], route: str) -> Response:
        self.requests.append(body)
        self.in_progress += 1
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            token_ids = request_prompt_token_ids(self.tokenizer, route, body) or []
            with self._lock:
                hit = self.store(token_ids)
            self.answered += 1
        finally:
            self.in_progress -= 1
        if body.get("stream"):
            return StreamingResponse(self._stream(), media_type="text/event-stream")
        return JSONResponse(self._answer(body, route, len(token_ids), hit))

    def _answer(self, body: dict[str, Any], route: str, num_tokens: int, hit: int) -> dict[str, Any]:
        is_prefill = (body.get("kv_transfer_params") or {}).get("do_remote_decode")
        stops = bool(is_prefill) and (self.stop_on_first_token or body.get("prompt") in self.stop_prompts)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "stop_reason": None,
                                  "finish_reason": "stop" if stops else "length"}
        if route.endswith("chat/completions"):
            choice["message"] = {"role": "assistant", "content": "" if stops else f"from {self.name}"}
        else:
            choice["text"] = "" if stops else f"from {self.name}"
        params = None
        if is_prefill and not stops:
            params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.name,
                      "remote_request_id": body.get("request_id"), "remote_block_ids": [1],
                      "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1}
        return {"id": f"cmpl-{body.get('request_id')}", "object": "text_completion", "created": 1,
                "model": "tiny", "choices": [choice],
                "usage": {"prompt_tokens": num_tokens, "completion_tokens": 1, "total_tokens": num_tokens + 1,
                          "prompt_tokens_details": {"cached_tokens": hit + self.tail_hit_tokens * bool(hit)}},
                "kv_transfer_params": params}

    async def _stream(self) -> AsyncIterator[bytes]:
        for i in range(self.num_chunks):
            if i:
                await asyncio.sleep(self.chunk_delay)
            chunk = {"choices": [{"index": 0, "delta": {"content": f"tok{i} "}}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"

"""`usage.prompt_tokens_details.cached_tokens` equals a real vLLM 0.32's for the same local and
external hits: the default model, block size 32, the ExampleConnector (the same shared-storage
connector in both engines) for the external ones."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.vllm_serve import SERVED_NAME, VllmServer

pytestmark = pytest.mark.timeout(300)

BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32


def example_connector(storage: Path) -> dict[str, Any]:
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)}}


def usage(post: Any, token_ids: list[int]) -> tuple[int, int]:
    """(prompt_tokens, cached_tokens) of a one-token completion of `token_ids`."""
    response = post("/v1/completions", json={"model": SERVED_NAME, "prompt": token_ids, "max_tokens": 1,
                                              "temperature": 0.0})
    assert response.status_code == 200, response.text
    answer = response.json()["usage"]
    return answer["prompt_tokens"], answer["prompt_tokens_details"]["cached_tokens"]


@contextmanager
def kvrelay_server(storage: Path) -> Iterator[TestClient]:
    """`kvrelay serve`'s app on the default model, in this process."""
    from kvrelay import LLM
    from kvrelay.engine.async_llm import AsyncLLM
    from kvrelay.entrypoints.openai_server import build_app

    llm = LLM(block_size=BLOCK_SIZE, num_blocks=64, kv_transfer_config=example_connector(storage))
    async_llm = AsyncLLM(llm.engine)
    try:
        with TestClient(build_app(async_llm, SERVED_NAME)) as client:
            yield client
        assert llm.engine.blocks_in_use == 0
    finally:
        async_llm.shutdown()


def test_cached_tokens_count_local_and_connector_hits_as_vllm_does(tmp_path: Path) -> None:
    from kvrelay.model.loader import load_tokenizer

    vllm = VllmServer(tmp_path / "vllm.log", "--enable-prompt-tokens-details", "--block-size", "32",
                      "--kv-transfer-config", json.dumps(example_connector(tmp_path / "vllm-kv")),
                      env={"VLLM_SERVER_DEV_MODE": "1"})  # POST /reset_prefix_cache
    with vllm:
        tokens = load_tokenizer(None).encode(" ".join(f"word{i} is {i * 7 % 13}" for i in range(200)))
        assert len(tokens) >= 600
        a = tokens[:290]  # 9 full blocks and 2 tokens: a hit covers 288
        b = a[:100] + tokens[300:360]  # shares 3 full blocks with a
        c = tokens[400:600]
        with kvrelay_server(tmp_path / "kvrelay-kv") as first:  # while vLLM starts
            # A fresh prompt, the same one again (a local hit), another fresh one.
            kvrelay = [usage(first.post, p) for p in (a, a, c)]
        with kvrelay_server(tmp_path / "kvrelay-kv") as second:  # an empty local cache
            # c from storage alone; b (nothing stored); a: b's 3 blocks locally, the rest stored.
            kvrelay += [usage(second.post, p) for p in (c, b, a)]
        vllm.wait_healthy()

        def post(path: str, **kwargs: Any) -> httpx.Response:
            return httpx.post(vllm.url + path, timeout=60, **kwargs)

        theirs = [usage(post, p) for p in (a, a, c)]
        assert post("/reset_prefix_cache").status_code == 200
        theirs += [usage(post, p) for p in (c, b, a)]
    assert kvrelay == theirs
    assert [cached for _, cached in theirs] == [0, 288, 0, 192, 0, 288]  # the cases are what they say

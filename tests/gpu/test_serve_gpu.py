"""`kvrelay serve --device cuda` answers an OpenAI request (skipped without a CUDA device)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from tests.entrypoints.serve_process import ServeProcess
from tests.tiny import write_tiny_model_dir

NO_GPU = "needs a CUDA device: torch sees none"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)]


def test_serve_on_cuda_answers_a_completion_and_a_chat(tmp_path: Path) -> None:
    model_dir = write_tiny_model_dir(tmp_path / "tiny")
    server = ServeProcess(model_dir, tmp_path / "serve.log", "--device", "cuda",
                          "--kv-cache-memory", "512MiB",  # not millions of blocks for a tiny model
                          "--served-model-name", "tiny")
    try:
        server.wait_healthy(180)
        completion = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "t5 t6 t7 t8", "max_tokens": 8, "temperature": 0.0})
        assert completion.status_code == 200, completion.text
        assert completion.json()["usage"]["completion_tokens"] > 0
        chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "t9 t10"}], "max_tokens": 4})
        assert chat.status_code == 200, chat.text
    finally:
        code = server.stop()
    assert code == 0, server.log()

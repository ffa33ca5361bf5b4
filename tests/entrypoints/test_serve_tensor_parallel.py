"""`kvrelay serve -tp 2` as a real process: it answers like TP 1, and when one of its worker
processes is killed mid-request the request fails, /health stops answering 200, the server exits
non-zero within a bounded time and leaves no worker process behind."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvrelay import LLM, SamplingParams
from tests.entrypoints.serve_process import ServeProcess
from tests.tiny import write_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model_dir(tmp_path_factory.mktemp("tp_model"))


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4: the parent pid
            found.append(int(entry))
    return found


def is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stream_completion(url: str, body: dict, into: list[str]) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            into.append(f"status {response.status_code}")
            for line in response.iter_lines():
                into.append(line)
    except httpx.HTTPError as error:  # the server went away mid-stream: also a failure
        into.append(f"transport error {error!r}")


def test_tp2_server_answers_like_tp1_and_dies_loudly_when_a_worker_is_killed(model_dir: Path,
                                                                            tmp_path: Path) -> None:
    want = LLM(str(model_dir), num_blocks=64).generate(
        {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    server = ServeProcess(model_dir, tmp_path / "serve.log", "-tp", "2", "--kv-cache-memory", "4MiB")
    try:
        server.wait_healthy(timeout_s=240)
        answer = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True}).json()
        assert answer["choices"][0]["text"] == want
        workers = children_of(server.proc.pid)
        assert len(workers) >= 2, server.log()

        lines: list[str] = []
        body = {"prompt": [5, 6, 7], "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True}
        reader = threading.Thread(target=stream_completion, args=(server.url, body, lines), daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while not any(line.startswith("data: {") for line in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(workers[-1], signal.SIGKILL)
        assert server.proc.wait(timeout=60) != 0, server.log()
        reader.join(timeout=60)
        finished = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert not any(chunk["choices"][0].get("finish_reason") == "length" for chunk in finished
                       if chunk.get("choices")), "the request ran to its end after its worker died"
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{server.url}/health", timeout=2)
        assert not [pid for pid in workers if is_running(pid)], "a worker process outlived the server"
        assert "worker" in server.log() and "died" in server.log()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(10)

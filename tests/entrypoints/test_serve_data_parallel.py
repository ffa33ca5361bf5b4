"""`kvrelay serve --data-parallel-size 2` as a real process: two ranks, each a whole engine in its own
worker process, behind one port. Both serve; vLLM's X-data-parallel-rank header picks one; /health,
/metrics and /kv_events name each rank; killing one rank's worker takes that rank (only) out of
service; a KV port range past 65535 is refused before anything starts. (How DataParallelLLM
starts its ranks, and each rank's config: tests/engine/test_data_parallel.py.)"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay import LLM, SamplingParams
from kvrelay.entrypoints.cli import main
from kvrelay.kv_events.events import KVEventBatch
from kvrelay.kv_events.subscriber import KVEventSubscriber, StreamAddress
from tests.entrypoints.serve_process import ServeProcess
from tests.entrypoints.test_serve_tensor_parallel import children_of, is_running
from tests.kv_transfer.transport.helpers import wait_for
from tests.tiny import write_tiny_model_dir

MAX_TOKENS = 5
PROMPTS = [[3 + k, 40 + k, 9, 17 + 2 * k, 23, 5 + k] for k in range(6)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model_dir(tmp_path_factory.mktemp("dp_model"))


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    logs = tmp_path_factory.mktemp("dp_serve")
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"ipc://{logs}/pub",
                         "replay_endpoint": f"ipc://{logs}/replay"})
    proc = ServeProcess(model_dir, logs / "serve.log", "--data-parallel-size", "2",
                        "--kv-cache-memory", "4MiB", "--kv-events-config", events)
    try:
        proc.wait_healthy(timeout_s=240)
        yield proc
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait(10)


def complete(url: str, prompt: list[int], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=headers, timeout=60, json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})


def samples(url: str) -> dict[tuple[str, str | None], float]:
    """(sample name, dp_rank label) -> value, other labels summed."""
    found: dict[tuple[str, str | None], float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            key = (sample.name, sample.labels.get("dp_rank"))
            found[key] = found.get(key, 0.0) + sample.value
    return found


def wait_idle(url: str, ranks: tuple[str, ...] = ("0", "1"), timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        m = samples(url)
        if all(m[("kvrelay_kv_blocks_in_use", r)] == 0 and m[("kvrelay_num_requests_running", r)] == 0
               for r in ranks):
            return
        assert time.monotonic() < deadline, f"ranks {ranks} still hold blocks or requests: {m}"
        time.sleep(0.1)


def test_both_ranks_answer_through_one_port_as_one_engine_would(server: ServeProcess,
                                                                model_dir: Path) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    single = LLM(str(model_dir), num_blocks=64)
    try:
        want = [out.outputs[0].text for out in single.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    finally:
        single.engine.shutdown()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: complete(server.url, p), PROMPTS))
    assert [a.status_code for a in answers] == [200] * len(PROMPTS)
    assert [a.json()["choices"][0]["text"] for a in answers] == want
    assert {a.headers["X-data-parallel-rank"] for a in answers} == {"0", "1"}
    wait_idle(server.url)
    m = samples(server.url)
    assert m[("kvrelay_generation_tokens_total", "0")] > 0 and m[("kvrelay_generation_tokens_total", "1")] > 0
    assert m[("kvrelay_generation_tokens_total", "0")] + m[("kvrelay_generation_tokens_total", "1")] == \
        MAX_TOKENS * len(PROMPTS)


def test_the_x_data_parallel_rank_header_picks_the_rank_and_a_bad_one_is_a_400(server: ServeProcess) -> None:
    finished = ("kvrelay_requests_finished_total", "1")
    before = samples(server.url).get(finished, 0.0)
    for _ in range(2):
        answer = complete(server.url, PROMPTS[0], {"X-data-parallel-rank": "1"})
        assert answer.status_code == 200 and answer.headers["X-data-parallel-rank"] == "1"
    assert samples(server.url)[finished] == before + 2
    for bad, why in (("2", "out of range [0, 2)"), ("-1", "out of range [0, 2)"), ("one", "an integer")):
        refused = complete(server.url, PROMPTS[0], {"X-data-parallel-rank": bad})
        assert refused.status_code == 400, refused.text
        assert why in refused.json()["error"]["message"]
        assert refused.json()["error"]["param"] == "X-data-parallel-rank"


def test_a_repeated_prompt_returns_to_the_rank_that_cached_its_prefix(server: ServeProcess) -> None:
    prompt = [100 + i for i in range(40)]  # two full blocks of 16 and a partial one
    first, again = complete(server.url, prompt), complete(server.url, prompt)
    assert again.headers["X-data-parallel-rank"] == first.headers["X-data-parallel-rank"]
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


class RanksSeen:
    def __init__(self) -> None:
        self.ranks: dict[str, set[int | None]] = {}

    def on_batch(self, source: str, seq: int, batch: KVEventBatch) -> None:
        self.ranks.setdefault(source, set()).add(batch.data_parallel_rank)

    def on_reset(self, source: str, reason: str) -> None:
        return None


def test_each_ranks_kv_events_come_on_its_own_endpoint_tagged_with_its_rank(server: ServeProcess) -> None:
    seen = RanksSeen()
    subscriber = KVEventSubscriber(seen)
    try:
        for rank in httpx.get(f"{server.url}/kv_events", timeout=10).json()["ranks"]:
            address = StreamAddress(rank["endpoint"], rank["replay_endpoint"])
            subscriber.add(f"rank {rank['dp_rank']}", address)
        for rank in ("0", "1"):
            assert complete(server.url, [7, 8, 9, 10] * 5, {"X-data-parallel-rank": rank}).status_code == 200
        wait_for(lambda: set(seen.ranks) == {"rank 0", "rank 1"}, what="both ranks' KV events")
    finally:
        subscriber.close()
    assert seen.ranks == {"rank 0": {0}, "rank 1": {1}}


def test_health_metrics_and_kv_events_name_each_rank(server: ServeProcess) -> None:
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200
    assert health.json()["status"] == "ok" and [r["dp_rank"] for r in health.json()["ranks"]] == [0, 1]
    events = httpx.get(f"{server.url}/kv_events", timeout=10).json()
    assert events["data_parallel_size"] == 2
    assert [r["endpoint"] for r in events["ranks"]] == [events["endpoint"], events["endpoint"] + "_dp1"]
    m = samples(server.url)
    for name in ("kvrelay_kv_blocks_total", "kvrelay_prompt_tokens_computed_total",
                 "kvrelay_time_to_first_token_seconds_count"):
        assert (name, "0") in m and (name, "1") in m and (name, None) not in m


def test_killing_one_ranks_worker_takes_only_that_rank_out(server: ServeProcess) -> None:
    workers = {Path(f"/proc/{pid}/comm").read_text().strip(): pid for pid in children_of(server.proc.pid)
               if Path(f"/proc/{pid}/comm").exists()}
    assert {"kvrelay-dp0tp0", "kvrelay-dp1tp0"} <= set(workers), workers
    os.kill(workers["kvrelay-dp1tp0"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while (health := httpx.get(f"{server.url}/health", timeout=10)).json()["status"] == "ok":
        assert time.monotonic() < deadline, "/health did not notice the dead rank"
        time.sleep(0.1)
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    rank0, rank1 = health.json()["ranks"]
    assert rank0["status"] == "ok" and rank1["status"] == "down"
    assert f"pid {workers['kvrelay-dp1tp0']}" in rank1["reason"]

    answers = [complete(server.url, prompt) for prompt in PROMPTS[:4]]
    assert [(a.status_code, a.headers["X-data-parallel-rank"]) for a in answers] == [(200, "0")] * 4
    named = complete(server.url, PROMPTS[0], {"X-data-parallel-rank": "1"})
    assert named.status_code == 503 and "rank 1 is down" in named.json()["error"]["message"]
    wait_idle(server.url, ranks=("0",))

    assert server.stop() == 1, server.log()  # a rank died: the exit status says so
    deadline = time.monotonic() + 10  # NOTE: the multiprocessing resource tracker exits after its server
    while (left := [pid for pid in workers.values() if is_running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes outlived the server: {left}"
    assert "data-parallel rank 1 is down" in server.log()


def test_a_kv_port_range_past_65535_is_refused_at_start_with_the_numbers(
        capsys: pytest.CaptureFixture[str]) -> None:
    def serve(kv_port: int) -> int:
        config = f'{{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_port": {kv_port}}}'
        return main(["serve", "-dp", "3", "-tp", "2", "--kv-transfer-config", config, "--port", "1"])

    assert serve(65531) == 2  # before loading anything: --port 1 would fail later
    err = capsys.readouterr().err
    assert "3 data-parallel rank(s) of 2 tensor-parallel rank(s)" in err
    assert "kv_port + dp_rank * 2 + tp_rank = 65531..65536" in err
    assert "give a kv_port of at most 65530" in err
    assert main(["serve", "--data-parallel-rank", "1"]) == 2
    assert "data_parallel_rank must be in [0, data_parallel_size=1)" in capsys.readouterr().err

"""`kvrelay up --prefill-dp 2 --decode-dp 2`: one P and one D instance of two data-parallel ranks
each, behind the proxy. Answers equal one engine's; D reads each prompt's KV from the P rank that
computed it (the rank's own engine id and side-channel port in P's kv_transfer_params); every rank
ends with no block in use and no process outlives the cluster."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay import LLM, SamplingParams
from kvrelay.disagg.launcher import ClusterSpec, LocalCluster
from kvrelay.disagg.proxy import PREFILL_KV_TRANSFER_PARAMS
from kvrelay.entrypoints.cli import main
from tests.entrypoints.test_serve_tensor_parallel import children_of, is_running
from tests.tiny import write_tiny_model_dir

SERVE_ARGS = ("--served-model-name", "tiny", "--kv-cache-memory", "4MiB", "--log-level", "warning")
MAX_TOKENS = 6
# Distinct prompts of the tiny vocabulary ("t17" is token 17), from under a block to several.
PROMPTS = [" ".join(f"t{(5 * i + 11 * k) % 240 + 3}" for i in range(n))
           for k, n in enumerate((7, 20, 33, 45))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model_dir(tmp_path_factory.mktemp("up_dp_model"))


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[LocalCluster]:
    """The cluster; once its tests ran, stopping it must leave no process behind."""
    spec = ClusterSpec(model=str(model_dir), port=0, threads_per_instance=1, serve_args=SERVE_ARGS,
                       prefill_dp=2, decode_dp=2, startup_timeout=300, grace_period=10)
    with LocalCluster(spec) as running:
        yield running
        processes = [pid for child in running.children if child.pid is not None
                     for pid in (child.pid, *children_of(child.pid))]
        assert len(processes) >= 3 + 4, processes  # P, D and the proxy; each instance's two ranks' workers
    deadline = time.monotonic() + 15
    while (left := [pid for pid in processes if is_running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes outlived the cluster: {left}"


def single_answers(model_dir: Path, prompts: list[str]) -> list[str]:
    llm = LLM(str(model_dir), num_blocks=64)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.engine.shutdown()
    return [out.outputs[0].text for out in outs]


def complete(url: str, prompt: str, headers: dict[str, str] | None = None, **fields: Any) -> dict[str, Any]:
    answer = httpx.post(url + "/v1/completions", headers=headers, timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
        **fields})
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def by_rank(url: str, name: str) -> dict[str, float]:
    """One metric of every rank of an instance: dp_rank -> value."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name:
                found[sample.labels["dp_rank"]] = sample.value
    return found


def wait_all_free(urls: list[str], timeout_s: float = 20.0) -> dict[str, dict[str, float]]:
    deadline = time.monotonic() + timeout_s
    while True:
        in_use = {url: by_rank(url, "kvrelay_kv_blocks_in_use") for url in urls}
        if all(v == 0 for ranks in in_use.values() for v in ranks.values()) or time.monotonic() > deadline:
            return in_use
        time.sleep(0.2)


def test_answers_through_the_proxy_equal_one_engine_and_d_loads_every_prompt_from_p(
        cluster: LocalCluster, model_dir: Path) -> None:
    (p,), (d,) = cluster.prefill, cluster.decode
    want = single_answers(model_dir, PROMPTS)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda prompt: complete(cluster.url, prompt)["choices"][0]["text"], PROMPTS))
    assert got == want
    computed_p = by_rank(p.url, "kvrelay_prompt_tokens_computed_total")
    loaded_d = by_rank(d.url, "kvrelay_prompt_tokens_external_total")
    computed_d = by_rank(d.url, "kvrelay_prompt_tokens_computed_total")
    assert sorted(computed_p) == sorted(loaded_d) == ["0", "1"]
    n_prompt = [len(prompt.split()) for prompt in PROMPTS]
    assert sum(computed_p.values()) == sum(n_prompt)  # P computed each prompt once, somewhere
    assert sum(loaded_d.values()) == sum(n - 1 for n in n_prompt)  # D read all but the last token
    assert sum(computed_d.values()) == len(PROMPTS)  # and computed only that token
    assert sum(by_rank(d.url, "kvrelay_kv_load_failures_total").values()) == 0
    assert wait_all_free([p.url, d.url]) == {url: {"0": 0, "1": 0} for url in (p.url, d.url)}


def test_d_reads_from_the_p_rank_that_computed_the_prompt(cluster: LocalCluster, model_dir: Path) -> None:
    (p,), (d,) = cluster.prefill, cluster.decode
    prompt = " ".join(f"t{200 - i}" for i in range(26))
    p_base = int(cluster.kv_addresses[p.name].rsplit(":", 1)[1])
    for p_rank, d_rank in ((1, 0), (0, 1)):
        prefilled = complete(p.url, prompt, {"X-data-parallel-rank": str(p_rank)}, max_tokens=1,
                             kv_transfer_params=PREFILL_KV_TRANSFER_PARAMS)
        params = prefilled["kv_transfer_params"]
        assert params["remote_engine_id"].endswith(f"_dp{p_rank}")
        assert params["remote_port"] == p_base + p_rank  # kv_port + dp_rank * tp_size
        before = by_rank(d.url, "kvrelay_prompt_tokens_external_total")
        answer = complete(d.url, prompt, {"X-data-parallel-rank": str(d_rank)}, kv_transfer_params=params)
        assert answer["choices"][0]["text"] == single_answers(model_dir, [prompt])[0]
        loaded = by_rank(d.url, "kvrelay_prompt_tokens_external_total")
        assert loaded[str(d_rank)] - before[str(d_rank)] == 25
    assert wait_all_free([p.url, d.url]) == {url: {"0": 0, "1": 0} for url in (p.url, d.url)}


def test_push_mode_refuses_prefill_ranks_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--connector", "NixlPushConnector", "--prefill-dp", "2", "--port", "1"]) == 2
    assert "--prefill-dp must be 1 in push mode" in capsys.readouterr().err
    push = ClusterSpec(connector="NixlPushConnector", decode_dp=2)  # D's ranks each register with P
    assert push.instances == [("prefill-0", 1), ("decode-0", 2)]
    with pytest.raises(ValueError, match="decode_dp must be >= 1, got 0"):
        ClusterSpec(decode_dp=0)

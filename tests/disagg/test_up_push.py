"""`kvrelay up --connector NixlPushConnector`: real P, D and proxy processes on loopback, the
tiny model, both legs at once and P pushing its KV into D's blocks while it computes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvrelay.disagg.instance_info import TransferModeError
from kvrelay.disagg.launcher import ClusterSpec, LocalCluster
from kvrelay.disagg.legs import decode_body, prefill_body
from kvrelay.disagg.pool_manager import check_instances
from kvrelay.disagg.proxy import ProxyConfig
from tests.disagg.test_pd_e2e import PROMPTS, SERVE_ARGS, completion, metrics, wait_for_blocks_freed
from tests.entrypoints.serve_process import ServeProcess
from tests.tiny import write_tiny_model_dir

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="module")
def single(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    serve = ServeProcess(model_dir, tmp_path_factory.mktemp("single") / "serve.log", *SERVE_ARGS)
    try:
        serve.wait_healthy(180)
        yield serve
    finally:
        serve.stop()


@pytest.fixture(scope="module")
def push_cluster(model_dir: Path) -> Iterator[LocalCluster]:
    spec = ClusterSpec(model=str(model_dir), port=0, connector="NixlPushConnector", threads_per_instance=1,
                       serve_args=SERVE_ARGS, startup_timeout=180, grace_period=10)
    with LocalCluster(spec) as running:
        yield running


def test_push_cluster_answers_equal_a_single_instance_and_d_computes_one_token(
        push_cluster: LocalCluster, single: ServeProcess) -> None:
    (p,), (d,) = push_cluster.prefill, push_cluster.decode
    for prompt in PROMPTS:
        n_prompt = len(prompt.split())
        before = metrics(d.url)
        assert completion(push_cluster.url, prompt) == completion(single.url, prompt)
        after = metrics(d.url)
        computed, loaded, failures = (after[name] - before[name] for name in (
            "kvrelay_prompt_tokens_computed_total", "kvrelay_prompt_tokens_external_total",
            "kvrelay_kv_load_failures_total"))
        assert (loaded, computed, failures) == (n_prompt - 1, 1, 0), prompt
    assert completion(push_cluster.url, PROMPTS[2], stream=True) == completion(single.url, PROMPTS[2])
    assert wait_for_blocks_freed([p.url, d.url]) == {p.url: 0, d.url: 0}


def test_a_pull_mode_proxy_is_refused_and_d_names_it_when_handed_ps_pull_answer(
        push_cluster: LocalCluster, single: ServeProcess) -> None:
    (p,), (d,) = push_cluster.prefill, push_cluster.decode
    refused = (r"runs NixlPushConnector \(transfer mode push\).*but this proxy runs transfer mode pull.*"
               r"--transfer-mode push --prefill-kv")
    with pytest.raises(TransferModeError, match=refused):
        asyncio.run(check_instances(ProxyConfig(prefill_urls=(p.url,), decode_urls=(d.url,))))
    # What such a proxy did: P's answer to a pull-style prefill leg, handed to D. D no longer
    # waits for writes that never come: it recomputes at once and says why.
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0.0}
    answer = httpx.post(p.url + "/v1/completions", json=prefill_body(body, "pulled"), timeout=60).json()
    before = metrics(d.url)
    response = httpx.post(d.url + "/v1/completions", timeout=60,
                          json=decode_body(body, "pulled-d", answer["kv_transfer_params"]))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == completion(single.url, PROMPTS[2])
    assert metrics(d.url)["kvrelay_kv_load_failures_total"] - before["kvrelay_kv_load_failures_total"] == 1
    log = d.log_path.read_text()
    assert "P's answer to a pull-mode prefill leg" in log and "--transfer-mode push --prefill-kv" in log
    assert wait_for_blocks_freed([p.url, d.url]) == {p.url: 0, d.url: 0}

"""`kvrelay up --connector NixlPushConnector`: real P, D and proxy processes on loopback, the
tiny model, both legs at once and P pushing its KV into D's blocks while it computes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrelay.disagg.launcher import ClusterSpec, LocalCluster
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

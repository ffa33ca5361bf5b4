"""`kvrelay up --batch-invariant`: real P, D and proxy processes, the tiny model, pull and push.
The answers through the proxy, tokens and the logprob of every token, are bitwise those of a
single instance in the mode (here in the test's process, at another thread count), with the
three prompts sent at once so that D batches them; P's own one-token answer (what the proxy
returns when that token ends the request) is the single instance's first token and logprob."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.disagg.launcher import ClusterSpec, LocalCluster
from tests.disagg.test_pd_e2e import PROMPTS, SERVE_ARGS, metrics, wait_for_blocks_freed
from tests.tiny import write_tiny_model_dir

pytestmark = pytest.mark.timeout(600)
MAX_TOKENS = 8
Answer = tuple[list[str], list[float]]  # the tokens' texts and logprobs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="module")
def single(model_dir: Path) -> dict[str, Answer]:
    """Each prompt alone on one in-process instance in the mode: tokens and logprobs."""
    with LLM(str(model_dir), block_size=16, kv_cache_memory="8MiB", batch_invariant=True) as llm:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)
        answers = {}
        for prompt in PROMPTS:
            completion = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
            steps = list(zip(completion.token_ids, completion.logprobs, strict=True))
            answers[prompt] = ([step[token].decoded_token or "" for token, step in steps],
                               [step[token].logprob for token, step in steps])
        return answers


def cluster_of(model_dir: Path, connector: str) -> Iterator[LocalCluster]:
    spec = ClusterSpec(model=str(model_dir), port=0, connector=connector, threads_per_instance=1,
                       serve_args=(*SERVE_ARGS, "--batch-invariant"), startup_timeout=180, grace_period=10)
    with LocalCluster(spec) as running:
        yield running


@pytest.fixture(scope="module", params=["NixlConnector", "NixlPushConnector"], ids=["pull", "push"])
def cluster(model_dir: Path, request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    yield from cluster_of(model_dir, request.param)


def answer(url: str, prompt: str, max_tokens: int = MAX_TOKENS) -> Answer:
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "logprobs": 0}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    return list(logprobs["tokens"]), list(logprobs["token_logprobs"])


def test_answers_through_p_and_d_are_bitwise_a_single_instances(
        cluster: LocalCluster, single: dict[str, Answer]) -> None:
    (p,), (d,) = cluster.prefill, cluster.decode
    before = metrics(d.url)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: D runs them in one batch
        got = dict(zip(PROMPTS, pool.map(lambda prompt: answer(cluster.url, prompt), PROMPTS), strict=True))
    assert got == single
    after = metrics(d.url)
    computed, failures, refused = (after[name] - before[name] for name in (
        "kvrelay_prompt_tokens_computed_total", "kvrelay_kv_load_failures_total",
        "kvrelay_kv_transfer_incompatible_total"))
    assert (computed, failures, refused) == (len(PROMPTS), 0, 0)  # D computed each last prompt token only
    for prompt in PROMPTS:  # P's token, which the proxy answers with when it ends the request
        tokens, logprobs = answer(p.url, prompt, max_tokens=1)
        assert (tokens, logprobs) == (single[prompt][0][:1], single[prompt][1][:1])
    assert wait_for_blocks_freed([p.url, d.url]) == {p.url: 0, d.url: 0}

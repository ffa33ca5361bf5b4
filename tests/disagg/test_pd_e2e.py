"""Real P, D and proxy processes on loopback, a tiny model, and the default NixlConnector between them."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.disagg.launcher import ClusterSpec, LocalCluster
from kvrelay.disagg.legs import decode_body, prefill_body
from kvrelay.disagg.proxy import ProxyConfig, build_app
from tests.disagg.servers import ServerThread, closed_port_url
from tests.entrypoints.serve_process import ROOT, ServeProcess
from tests.tiny import write_tiny_model_dir

BLOCK_SIZE = 16
SERVE_ARGS = ("--served-model-name", "tiny", "--kv-cache-memory", "8MiB", "--block-size", str(BLOCK_SIZE),
              "--log-level", "warning")
# Prompts of the tiny word-level vocabulary ("t17" is token 17): shorter than a block, exactly
# two blocks, and several blocks with a partial last one.
PROMPTS = [" ".join(f"t{(7 * i + k) % 250 + 2}" for i in range(n)) for k, n in ((1, 5), (2, 32), (3, 75))]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[LocalCluster]:
    spec = ClusterSpec(model=str(model_dir), port=0, threads_per_instance=1, serve_args=SERVE_ARGS,
                       startup_timeout=180, grace_period=10)
    with LocalCluster(spec) as running:
        yield running


@pytest.fixture(scope="module")
def single(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    serve = ServeProcess(model_dir, tmp_path_factory.mktemp("single") / "serve.log", *SERVE_ARGS)
    try:
        serve.wait_healthy(180)
        yield serve
    finally:
        serve.stop()


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def completion(url: str, prompt: str, stream: bool = False, model: str = "tiny") -> str:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                            "temperature": 0.0, "stream": stream}
    if not stream:
        response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["text"])
    import json

    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices", []):
                    text += choice.get("text") or ""
    return text


def model_name(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])


def wait_for_blocks_freed(urls: list[str], timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        in_use = {url: metrics(url)["kvrelay_kv_blocks_in_use"] for url in urls}
        if all(v == 0 for v in in_use.values()) or time.monotonic() > deadline:
            return in_use
        time.sleep(0.2)


def test_greedy_answers_through_the_proxy_equal_a_single_instance_and_d_does_not_recompute(
        cluster: LocalCluster, single: ServeProcess) -> None:
    (p,), (d,) = cluster.prefill, cluster.decode
    for prompt in PROMPTS:
        n_prompt = len(prompt.split())
        before = metrics(d.url)
        assert completion(cluster.url, prompt) == completion(single.url, prompt)
        after = metrics(d.url)
        computed, loaded = (after[name] - before[name] for name in (
            "kvrelay_prompt_tokens_computed_total", "kvrelay_prompt_tokens_external_total"))
        # NixlConnector (the default): D pulls every prompt block, partial last block included,
        # and computes only the last prompt token again (it yields the first output's logits).
        assert loaded == n_prompt - 1, (prompt, loaded)
        assert computed == 1, (prompt, computed)
    # A streamed answer through the proxy assembles to the same text.
    assert completion(cluster.url, PROMPTS[2], stream=True) == completion(single.url, PROMPTS[2])
    assert wait_for_blocks_freed([p.url, d.url]) == {p.url: 0, d.url: 0}


def test_chat_through_the_proxy_equals_a_single_instance(cluster: LocalCluster, single: ServeProcess) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[1]}],
            "max_tokens": MAX_TOKENS, "temperature": 0.0}
    via_proxy = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=60).json()
    alone = httpx.post(single.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert via_proxy["choices"][0]["message"] == alone["choices"][0]["message"]
    assert via_proxy["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"]


def _tail(n_prompt: int) -> int:
    """Prompt tokens a sibling choice computes after a full prefix hit (1 to BLOCK_SIZE)."""
    return n_prompt - (n_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_of_a_prompt_list_through_the_proxy_compute_each_prompt_once_on_p(
        cluster: LocalCluster, single: ServeProcess, stream: bool) -> None:
    import json

    (p,), (d,) = cluster.prefill, cluster.decode
    offset = 100 if stream else 0  # fresh prompts: nothing of them is in any prefix cache yet
    lengths = [20, 37]
    prompts = [" ".join(f"t{offset + start + i}" for i in range(n))
               for start, n in zip((10, 40), lengths, strict=True)]
    body = {"model": "tiny", "prompt": prompts, "n": 2, "seed": 3, "max_tokens": 4, "temperature": 1.0,
            "ignore_eos": True}
    before_p, before_d = metrics(p.url), metrics(d.url)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
        response = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        texts = {i: "" for i in range(4)}
        for event in events[:-1]:
            for choice in event["choices"]:
                texts[choice["index"]] += choice["text"]
        got, usage = [texts[i] for i in range(4)], events[-1]["usage"]
    else:
        answer = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60).json()
        assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
        got, usage = [c["text"] for c in answer["choices"]], answer["usage"]
    alone = httpx.post(single.url + "/v1/completions", json={**body, "stream": False, "stream_options": None},
                       timeout=60).json()
    assert got == [c["text"] for c in alone["choices"]]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (57, 16)
    after_p, after_d = metrics(p.url), metrics(d.url)

    def grew(after: dict[str, float], before: dict[str, float], name: str) -> float:
        return after[f"kvrelay_{name}_total"] - before[f"kvrelay_{name}_total"]
    # P computed each prompt exactly once (one sample per prompt, whatever n is).
    assert grew(after_p, before_p, "prompt_tokens_computed") == sum(lengths)
    # D loaded each prompt once (all but the last token); choice 0 computes that last token and
    # choice 1 finds the loaded full blocks in D's prefix cache and computes only its tail.
    assert grew(after_d, before_d, "prompt_tokens_external") == sum(n - 1 for n in lengths)
    assert grew(after_d, before_d, "prompt_tokens_computed") == sum(1 + _tail(n) for n in lengths)
    assert grew(after_d, before_d, "generation_tokens") == 16
    assert wait_for_blocks_freed([p.url, d.url]) == {p.url: 0, d.url: 0}


def test_proxy_with_prefill_down_answers_via_fallback(cluster: LocalCluster, single: ServeProcess) -> None:
    (d,) = cluster.decode
    prompt = "t201 t202 t203 t204 t205 t206 t207 t208 t209 t210 t211 t212 t213 t214 t215 t216 t217 t218"
    config = ProxyConfig(prefill_urls=(closed_port_url(),), decode_urls=(d.url,))
    with ServerThread(build_app(config)) as proxy:
        before = metrics(d.url)["kvrelay_prompt_tokens_computed_total"]
        assert completion(proxy.url, prompt) == completion(single.url, prompt)
        assert metrics(proxy.url)["kvrelay_proxy_fallbacks_total"] == 1
    # D computed the whole prompt itself: nobody had stored it.
    assert metrics(d.url)["kvrelay_prompt_tokens_computed_total"] - before == len(prompt.split())
    assert wait_for_blocks_freed([d.url]) == {d.url: 0}


def test_proxy_health_lists_the_cluster_backends(cluster: LocalCluster) -> None:
    health = httpx.get(cluster.url + "/health", timeout=10).json()
    assert health["status"] == "ok"
    assert [b["url"] for b in health["prefill"]] == [c.url for c in cluster.prefill]
    assert [b["url"] for b in health["decode"]] == [c.url for c in cluster.decode]


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _processes_mentioning(needle: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return [pid for pid in found if _alive(pid)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kvrelay_up_serves_a_request_and_sigint_leaves_no_process_behind(tmp_path: Path) -> None:
    """`kvrelay up --api-key`: the banner says what runs and prints commands that run as printed;
    the proxy and the instances require the key (not /health, /metrics); SIGINT stops every
    process and removes the cluster's directory, its ipc:// event sockets with it."""
    model_dir = write_tiny_model_dir(tmp_path / "up_model")  # its own path, to find its processes
    cmd = [sys.executable, "-m", "kvrelay.entrypoints.cli", "up", str(model_dir), "--port", "0",
           "--threads-per-instance", "1", "--kv-cache-memory", "8MiB", "--startup-timeout", "180",
           "--api-key", "up-sekret"]
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    up = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    banner: list[str] = []
    try:
        assert up.stdout is not None
        for line in up.stdout:
            banner.append(line)
            if line.startswith("Ctrl-C stops everything"):
                break
        text = "".join(banner)
        match = re.search(r"ready at (http://127\.0\.0\.1:\d+)", text)
        assert match, text
        child_pids = [int(pid) for pid in re.findall(r" pid (\d+) ", text)]
        assert len(child_pids) == 3, text  # P, D and the proxy
        assert re.search(r"connector +NixlConnector \(pull: D reads P's blocks after P answered\), "
                         r"transport (nixl|tcp)\n", text), text
        assert re.search(r"offload +off \(--offload", text) and re.search(r"routing +prefill kv-aware, "
                                                                         r"decode kv-aware", text), text
        demo = re.search(r"\n  (\S+) demo --url ", text)
        assert demo and shutil.which(demo.group(1)), text  # runnable as printed
        (events,) = {Path(p).parent.parent / "events" for p in re.findall(r" log (\S+)", text)}
        assert {p.name for p in events.iterdir()} >= {"prefill-0.pub", "decode-0.replay"}
        url = match.group(1)
        body = {"model": "x", "prompt": PROMPTS[1], "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 401
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200
        key = {"Authorization": "Bearer up-sekret"}
        name = httpx.get(url + "/v1/models", headers=key, timeout=10).json()["data"][0]["id"]
        answer = httpx.post(url + "/v1/completions", json={**body, "model": name}, headers=key, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert [pid for pid in child_pids if _alive(pid)] == []
    assert _processes_mentioning(str(model_dir)) == []
    assert os.getpid() not in child_pids
    assert not events.parent.exists() and list(tmp_path.glob("kvrelay-*")) == []


def test_demo_streams_answers_and_shows_the_prompt_was_loaded_on_d(cluster: LocalCluster) -> None:
    import io

    from kvrelay.disagg.demo import run_demo

    out = io.StringIO()
    results = run_demo(cluster.url, max_tokens=4, prompts=[PROMPTS[2]], out=out)
    text = out.getvalue()
    assert [r.ok for r in results] == [True] and results[0].ttft is not None
    assert "TTFT" in text and "ITL" in text
    assert "prompt tokens computed" in text and "KV bytes moved" in text
    loaded = re.search(r"D loaded the KV of (\d+) of them", text)
    prompt_len = re.search(r"prompt (\d+) tokens", text)
    assert loaded and prompt_len, text
    assert int(loaded.group(1)) == int(prompt_len.group(1)) - 1, text  # all but the last token


# ---------------------------------------------------------------------- the client's mistakes


def test_a_client_error_through_the_proxy_is_ps_answer_and_nothing_runs_on_d(
        cluster: LocalCluster, single: ServeProcess) -> None:
    (p,), (d,) = cluster.prefill, cluster.decode
    bad = [{"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 3.0},
           {"model": "nope", "prompt": PROMPTS[1], "max_tokens": 4},
           {"model": "tiny", "prompt": "", "max_tokens": 4}]
    before_d, before_proxy = metrics(d.url), metrics(cluster.url)
    for body in bad:
        via_proxy = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
        alone = httpx.post(single.url + "/v1/completions", json=body, timeout=60)
        assert (via_proxy.status_code, via_proxy.json()) == (alone.status_code, alone.json())
        assert via_proxy.status_code in (400, 404)
    after_d, after_proxy = metrics(d.url), metrics(cluster.url)
    for name in ("kvrelay_requests_finished_total", "kvrelay_prompt_tokens_computed_total"):
        assert after_d.get(name, 0) == before_d.get(name, 0), name  # no decode leg
    grew = {name: after_proxy.get(name, 0) - before_proxy.get(name, 0) for name in (
        "kvrelay_proxy_client_errors_total", "kvrelay_proxy_fallbacks_total")}
    assert grew == {"kvrelay_proxy_client_errors_total": 3, "kvrelay_proxy_fallbacks_total": 0}
    assert wait_for_blocks_freed([p.url, d.url]) == {p.url: 0, d.url: 0}


def test_max_tokens_beyond_the_context_is_refused_by_the_proxy_before_p_computes(
        cluster: LocalCluster, single: ServeProcess) -> None:
    (p,), (d,) = cluster.prefill, cluster.decode
    context = httpx.get(d.url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": context, "temperature": 0.0}
    before_p = metrics(p.url)["kvrelay_prompt_tokens_computed_total"]
    via_proxy = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
    alone = httpx.post(single.url + "/v1/completions", json=body, timeout=60)
    assert via_proxy.status_code == 400 and via_proxy.json() == alone.json()  # vLLM's wording, D's limit
    assert metrics(p.url)["kvrelay_prompt_tokens_computed_total"] == before_p  # P computed nothing


@pytest.mark.parametrize("refused_for", ["max_tokens", "X-data-parallel-rank"])
def test_d_refusing_a_request_p_prefilled_for_it_frees_ps_blocks_at_once(cluster: LocalCluster,
                                                                         refused_for: str) -> None:
    """D refuses a max_tokens its context cannot hold, or a data-parallel rank it does not have."""
    (p,), (d,) = cluster.prefill, cluster.decode
    context = httpx.get(d.url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    max_tokens = context if refused_for == "max_tokens" else 4
    headers = {"X-data-parallel-rank": "3"} if refused_for != "max_tokens" else {}
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": max_tokens, "temperature": 0.0}
    answer = httpx.post(p.url + "/v1/completions", json=prefill_body(body, "refused"), timeout=60).json()
    assert metrics(p.url)["kvrelay_kv_blocks_in_use"] > 0  # held for D, under a 30 s lease
    expired = metrics(p.url)["kvrelay_kv_lease_expired_total"]
    refused = httpx.post(d.url + "/v1/completions", timeout=60, headers=headers,
                         json=decode_body(body, "refused-d", answer["kv_transfer_params"]))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == refused_for
    assert wait_for_blocks_freed([p.url], timeout=10) == {p.url: 0}  # D told P: no lease ran out
    assert metrics(p.url)["kvrelay_kv_lease_expired_total"] == expired

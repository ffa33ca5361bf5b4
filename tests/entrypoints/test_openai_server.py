"""`kvrelay serve` as a real process on loopback, driven by the official `openai` client and by
raw HTTP for bad input. The main server runs FakeConnector as a prefill instance would: it
returns kv_transfer_params and holds each finished request's blocks for two more steps."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.entrypoints.serve_process import ServeProcess
from tests.kv_transfer.fake_connector import fake_transfer_config
from tests.tiny import write_tiny_model_dir

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny-served"
P_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "fake-p",
            "remote_block_ids": [3, 4], "remote_host": "127.0.0.1", "remote_port": 1234}
METRIC_NAMES = [
    "kvrelay_kv_blocks_total", "kvrelay_kv_blocks_in_use", "kvrelay_num_requests_running",
    "kvrelay_num_requests_waiting", "kvrelay_num_requests_waiting_for_remote_kv",
    "kvrelay_prompt_tokens_computed_total", "kvrelay_prompt_tokens_cached_total",
    "kvrelay_prompt_tokens_external_total", "kvrelay_generation_tokens_total",
    "kvrelay_kv_transfer_bytes_total", "kvrelay_kv_transfer_seconds", "kvrelay_kv_transfer_failures_total",
    "kvrelay_kv_lease_expired_total", "kvrelay_time_to_first_token_seconds",
    "kvrelay_inter_token_latency_seconds",
]
GREEDY = {"temperature": 0.0}
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny-llama")


def _start(model_dir, log_path, *args, env=None) -> ServeProcess:
    server = ServeProcess(model_dir, log_path, "--block-size", "4", "--kv-cache-memory", "1MiB",
                          "--served-model-name", MODEL, *args, env=env)
    try:
        server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    kv_config = fake_transfer_config(kv_transfer_params=P_PARAMS, delay_free=True,
                                     auto_finish_sending_after=2)
    proc = _start(model_dir, tmp_path_factory.mktemp("logs") / "serve.log",
                  "--kv-transfer-config", json.dumps(kv_config))
    yield proc
    assert proc.stop() == 0, proc.log()
    assert "kvrelay serve stopped" in proc.log()


@pytest.fixture(scope="module")
def auth_server(model_dir, tmp_path_factory):
    proc = _start(model_dir, tmp_path_factory.mktemp("logs") / "serve-auth.log",
                  env={"KVRELAY_API_KEY": "sekret"})
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60, max_retries=0)


def metrics(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """Samples of /metrics by name (labels included, as written), e.g. `<histogram>_count`."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


ABORTED = 'kvrelay_requests_finished_total{finish_reason="abort"}'


def wait_settled(url: str, headers: dict[str, str] | None = None,
                 timeout_s: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(url, headers)
        busy = sum(m[f"kvrelay_{name}"] for name in ("kv_blocks_in_use", "num_requests_running",
                                                      "num_requests_waiting"))
        if busy == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not settle: {m}")
        time.sleep(0.05)


def post(url: str, route: str, body: object, headers: dict[str, str] | None = None,
         timeout: float | httpx.Timeout = 60):
    content = body if isinstance(body, str | bytes) else json.dumps(body)
    return httpx.post(f"{url}{route}", content=content, timeout=timeout,
                      headers={"Content-Type": "application/json", **(headers or {})})


# ----------------------------------------------------------------------------------- happy paths
def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_completion(client):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t5 t6 t7"}],
                                          max_tokens=5, extra_body=IGNORE_EOS, **GREEDY)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert len(choice.message.content.split()) == 5  # the word-level tokenizer: one word per token
    assert choice.finish_reason == "length"
    # "t2 user t5 t6 t7 t3 t4": the tiny chat template wraps the message in four words
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (7, 5, 12)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_streamed_chunks_assemble_to_the_non_streamed_text(client, route):
    kwargs = dict(model=MODEL, max_tokens=12, extra_body=IGNORE_EOS, **GREEDY)
    if route == "chat":
        create, messages = client.chat.completions.create, [{"role": "user", "content": "t9 t8"}]
        full = create(messages=messages, **kwargs).choices[0].message.content
        chunks = list(create(messages=messages, stream=True, **kwargs))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        create = client.completions.create
        full = create(prompt="t9 t8 t7", **kwargs).choices[0].text
        chunks = list(create(prompt="t9 t8 t7", stream=True, **kwargs))
        streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed == full and len(full.split()) == 12
    assert chunks[-1].choices[0].finish_reason == "length"


def test_usage_numbers_streamed_and_not(client):
    kwargs = dict(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=7, extra_body=IGNORE_EOS, **GREEDY)
    resp = client.completions.create(**kwargs)
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (4, 7, 11)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string_ends_the_text_before_it(client):
    kwargs = dict(model=MODEL, prompt="t11 t12", max_tokens=8, extra_body=IGNORE_EOS, **GREEDY)
    words = client.completions.create(**kwargs).choices[0].text.split()
    stop = " " + words[2]
    expected = " ".join(words)[: " ".join(words).index(stop)]
    resp = client.completions.create(stop=[stop], **kwargs)
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason == "stop"
    chunks = client.completions.create(stop=[stop], stream=True, **kwargs)
    streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed == expected


def test_completion_logprobs(client):
    resp = client.completions.create(model=MODEL, prompt="t20 t21", max_tokens=4, logprobs=3,
                                     extra_body=IGNORE_EOS, **GREEDY)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == resp.choices[0].text.replace(" ", "")
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and len(top) == 3
        assert top[token] == pytest.approx(value) and value == pytest.approx(max(top.values()))  # greedy


def test_chat_logprobs(client):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t30"}],
                                          max_tokens=3, logprobs=True, top_logprobs=2,
                                          extra_body=IGNORE_EOS, **GREEDY)
    content = resp.choices[0].logprobs.content
    assert [c.token for c in content] == resp.choices[0].message.content.split()
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token  # greedy: rank 1
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob


def test_kv_transfer_params_pass_through_and_come_back_top_level(client, server):
    incoming = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}
    resp = client.completions.create(model=MODEL, prompt="t40 t41 t42", max_tokens=1,
                                     extra_body={"kv_transfer_params": incoming, "request_id": "pd-1"})
    # P adds its own cache hit (vLLM's remote_prefill_cached_tokens), for D to report.
    cached = resp.usage.prompt_tokens_details.cached_tokens
    assert resp.model_extra["kv_transfer_params"] == {**P_PARAMS, "remote_prefill_cached_tokens": cached}
    assert resp.id == "cmpl-pd-1"
    chat = post(server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "t1"}],
                                                     "max_tokens": 1, "kv_transfer_params": incoming})
    cached = chat.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert chat.status_code == 200
    assert chat.json()["kv_transfer_params"] == {**P_PARAMS, "remote_prefill_cached_tokens": cached}
    wait_settled(server.url)  # the connector held the blocks, then released them


def test_request_id_from_header_and_reuse_while_held(server):
    ids = []
    for _ in range(2):  # the second arrives while the connector may still hold the first's blocks
        resp = post(server.url, "/v1/completions", {"prompt": "t3", "max_tokens": 1},
                    headers={"X-Request-Id": "client-id"})
        assert resp.status_code == 200
        ids.append(resp.json()["id"])
    assert ids[0] == "cmpl-client-id" and ids[1].startswith("cmpl-client-id")
    wait_settled(server.url)


def test_metrics_expose_every_name_and_settle_to_zero_blocks(client, server):
    client.completions.create(model=MODEL, prompt="t50 t51 t52 t53 t54", max_tokens=3, **GREEDY)
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    exposed = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")}
    for name in METRIC_NAMES:
        assert name in declared | exposed, name
    assert [name for name in exposed if name.endswith("_created")] == []  # no creation timestamps
    m = wait_settled(server.url)
    assert m["kvrelay_kv_blocks_in_use"] == 0 and m["kvrelay_kv_blocks_total"] > 0
    assert m["kvrelay_prompt_tokens_computed_total"] >= 5 and m["kvrelay_generation_tokens_total"] >= 3
    assert m["kvrelay_time_to_first_token_seconds_count"] >= 1
    assert m["kvrelay_inter_token_latency_seconds_count"] >= 1


def test_reset_prefix_cache_is_vllms_route_and_forgets_cached_prefixes(client, server):
    prompt = " ".join(f"t{i}" for i in range(80, 93))  # three full blocks of 4 and one token
    cached = []
    for reset_between in (False, True):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        wait_settled(server.url)
        if reset_between:
            answer = post(server.url, "/reset_prefix_cache?reset_external=true", None)
            assert answer.status_code == 200 and answer.json() == {"success": True}
        again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        cached.append(again.usage.prompt_tokens_details.cached_tokens)
        wait_settled(server.url)
    assert cached[0] >= 12 and cached[1] == 0


# ----------------------------------------------------------------------------------- bad input
BAD_REQUESTS = [
    # (route, body, status, words the message must contain, param)
    ("/v1/completions", '{"prompt": "t5",', 400, ["not valid JSON"], "body"),
    ("/v1/completions", "[1, 2]", 400, ["JSON object"], "body"),
    ("/v1/completions", {"max_tokens": 3}, 400, ["prompt", "required"], "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, ["prompt must be"], "prompt"),
    ("/v1/completions", {"prompt": "t5", "max_tokens": "3"}, 400, ["max_tokens", "integer"], "max_tokens"),
    ("/v1/completions", {"prompt": "t5", "temperature": "hot"}, 400, ["temperature"], "temperature"),
    ("/v1/completions", {"prompt": "t5", "stream": "yes"}, 400, ["stream"], "stream"),
    ("/v1/completions", {"prompt": "t5", "temperature": -1}, 400, ["temperature", "[0, 2]"], "temperature"),
    ("/v1/completions", {"prompt": "t5", "temperature": 2.5}, 400, ["temperature", "2.5"], "temperature"),
    ("/v1/completions", {"prompt": "t5", "top_p": 1.5}, 400, ["top_p"], "top_p"),
    ("/v1/completions", {"prompt": "t5", "max_tokens": 0}, 400, ["max_tokens"], "max_tokens"),
    ("/v1/completions", {"prompt": "t5", "logprobs": 99}, 400, ["logprobs"], "logprobs"),
    ("/v1/completions", {"prompt": "t5", "n": 0}, 400, ["n must be in [1, 16384]"], "n"),
    ("/v1/completions", {"prompt": "t5", "n": 2, "temperature": 0}, 400, ["n must be 1", "greedily"], "n"),
    ("/v1/completions", {"prompt": "t5", "seed": 2**63}, 400, ["seed", "64-bit"], "seed"),
    ("/v1/completions", {"prompt": "t5", "max_tokens": 10**9}, 400,
     ["'max_tokens' or 'max_completion_tokens' is too large: 1000000000",
      "maximum context length is 512 tokens and your request has 1 input tokens (1000000000 > 512 - 1)"],
     "max_tokens"),
    ("/v1/completions", {"prompt": [5] * 500}, 400, ["too large: 16.", "(16 > 512 - 500)"], "max_tokens"),
    ("/v1/completions", {"prompt": "t5", "stream_options": {"include_usage": True}}, 400,
     ["stream_options", "stream=true"], "stream_options"),
    ("/v1/completions", {"prompt": "t5", "logit_bias": {"5": 10}}, 400, ["logit_bias", "not supported"],
     "logit_bias"),
    ("/v1/completions", {"prompt": "t5", "use_beam_search": True}, 400, ["use_beam_search"],
     "use_beam_search"),
    ("/v1/completions", {"prompt": "t5", "response_format": {"type": "json_object"}}, 400,
     ["response_format", "not supported"], "response_format"),
    ("/v1/completions", {"prompt": "t5", "truncate_prompt_tokens": 500}, 400,
     ["truncate_prompt_tokens=500", "max_model_len - max_tokens = 496"], "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "t5", "truncate_prompt_tokens": -2}, 400, ["truncate_prompt_tokens"],
     "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "t5", "suffix": "t9"}, 400, ["suffix", "not supported"], "suffix"),
    ("/v1/completions", {"prompt": "t5", "n": 2, "best_of": 3}, 400, ["best_of=3"], "best_of"),
    ("/v1/completions", {"prompt": "t5", "echo": True, "logprobs": 1}, 400, ["echo", "logprobs"], "echo"),
    ("/v1/completions", {"prompt": ["t5", ""]}, 400, ["empty"], "prompt"),
    ("/v1/completions", {"prompt": ["t5", [5, 6]]}, 400, ["prompt must be"], "prompt"),
    ("/v1/completions", {"prompt": ["t5", "t6"], "kv_transfer_params": {"do_remote_decode": True}}, 400,
     ["list of 2 prompts", "one prompt per request"], "kv_transfer_params"),
    ("/v1/completions", {"prompt": "t5", "presence_penalty": 3}, 400, ["presence_penalty"],
     "presence_penalty"),
    ("/v1/completions", {"prompt": "t5 " * 600}, 400,
     ["maximum context length is 512 tokens. However, your request has 600 input tokens"], "prompt"),
    ("/v1/completions", {"prompt": [7, 9999]}, 400, ["9999", "vocabulary"], "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, ["empty"], "prompt"),
    ("/v1/completions", {"prompt": "t5", "model": "gpt-4"}, 404, ["gpt-4", "does not exist"], "model"),
    ("/v1/completions", {"prompt": "t5", "kv_transfer_params": "yes"}, 400, ["kv_transfer_params"],
     "kv_transfer_params"),
    ("/v1/completions", {"prompt": "t5", "kv_transfer_params": {"remote_block_ids": [1, "x"]}}, 400,
     ["remote_block_ids"], "kv_transfer_params"),
    ("/v1/completions", {"prompt": "t5", "kv_transfer_params": {"remote_port": "80"}}, 400,
     ["remote_port"], "kv_transfer_params"),
    ("/v1/completions", {"prompt": "t5", "kv_transfer_params": {"transfer_mode": "sideways"}}, 400,
     ["transfer_mode must be 'pull' or 'push'", "sideways"], "kv_transfer_params"),
    ("/v1/chat/completions", {"messages": []}, 400, ["messages"], "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, ["role"], "messages.0.role"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, ["messages"], "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t5"}], "top_logprobs": 2}, 400,
     ["logprobs"], "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t5"}], "model": "nope"}, 404,
     ["nope"], "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t5"}], "max_completion_tokens": 600},
     400, ["too large: 600", "(600 > 512 - 5)"], "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t5"}], "max_tokens": 600},
     400, ["too large: 600"], "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t5 " * 520}]}, 400,
     ["maximum context length is 512 tokens", "524 input tokens", "input messages"], "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t5"}], "tools": [
        {"type": "function", "function": {"name": "f"}}]}, 400, ["tools", "not supported"], "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t5"}], "stream": False,
                              "stream_options": {"include_usage": True}}, 400, ["stream_options"],
     "stream_options"),
    ("/tokenize", {}, 400, ["exactly one of 'prompt'"], "body"),
    ("/tokenize", {"prompt": "t5", "messages": [{"role": "user", "content": "t5"}]}, 400,
     ["exactly one of"], "body"),
    ("/tokenize", {"prompt": 5}, 400, ["prompt"], "prompt"),
    ("/tokenize", {"prompt": "t5", "model": "nope"}, 404, ["nope"], "model"),
    ("/detokenize", {"tokens": [5, 9999]}, 400, ["tokens[1]=9999", "vocabulary"], "tokens"),
    ("/detokenize", {"tokens": "t5"}, 400, ["tokens"], "tokens"),
    ("/detokenize", {}, 400, ["tokens", "required"], "tokens"),
]


@pytest.mark.parametrize("route, body, status, words, param", BAD_REQUESTS,
                         ids=[f"{i}-{r[0].removeprefix('/v1/')}" for i, r in enumerate(BAD_REQUESTS)])
def test_bad_input_is_a_clear_4xx(server, route, body, status, words, param):
    resp = post(server.url, route, body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    for word in words:
        assert word in error["message"], error
    assert error["param"] == param and error["code"] == status and error["type"]
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200


def test_unknown_route_is_404_in_openai_format(server):
    resp = httpx.get(f"{server.url}/v1/nothing", timeout=5)
    assert resp.status_code == 404 and "error" in resp.json()


def test_bad_input_leaks_nothing_and_server_keeps_serving(client, server):
    for route, body, *_ in BAD_REQUESTS:
        post(server.url, route, body)
    assert client.completions.create(model=MODEL, prompt="t5", max_tokens=2, extra_body=IGNORE_EOS).usage \
        .completion_tokens == 2
    assert wait_settled(server.url)["kvrelay_kv_blocks_in_use"] == 0


# ----------------------------------------------------------------------------------- disconnects
def test_client_disconnect_mid_stream_aborts_the_request(server):
    before = metrics(server.url)
    body = {"prompt": "t60 t61", "max_tokens": 400, "stream": True, **IGNORE_EOS, **GREEDY}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    after = wait_settled(server.url)
    assert after["kvrelay_kv_blocks_in_use"] == 0
    assert after["kvrelay_generation_tokens_total"] - before["kvrelay_generation_tokens_total"] < 400
    assert after[ABORTED] == before.get(ABORTED, 0) + 1


def test_client_disconnect_while_waiting_for_a_full_response_aborts(server):
    before = metrics(server.url)
    # NOTE: the tiny model decodes 500 tokens in well under a second here: the client gives up
    # after 50 ms of silence, long before the answer could be complete.
    with pytest.raises(httpx.ReadTimeout):
        post(server.url, "/v1/completions", {"prompt": "t70", "max_tokens": 500, **IGNORE_EOS},
             timeout=httpx.Timeout(30.0, read=0.05))
    after = wait_settled(server.url)
    assert after["kvrelay_generation_tokens_total"] - before["kvrelay_generation_tokens_total"] < 500
    assert after[ABORTED] == before.get(ABORTED, 0) + 1


# ----------------------------------------------------------------------------------- API key
def test_api_key_is_required_on_every_route_but_health_and_metrics(auth_server):
    url = auth_server.url
    body = {"prompt": "t5", "max_tokens": 1}
    missing = post(url, "/v1/completions", body)
    assert missing.status_code == 401 and "missing API key" in missing.json()["error"]["message"]
    wrong = post(url, "/v1/completions", body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "incorrect API key" in wrong.json()["error"]["message"]
    for path in ("/v1/models", "/version", "/kv_events"):
        assert httpx.get(f"{url}{path}", timeout=5).status_code == 401
    assert post(url, "/reset_prefix_cache", {}).status_code == 401
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    # Prometheus scrapes without the key, as vLLM 0.32 allows (its key guards only /v1 routes).
    scraped = httpx.get(f"{url}/metrics", timeout=5)
    assert scraped.status_code == 200 and "kvrelay_kv_blocks_in_use" in scraped.text

    authed = openai.OpenAI(base_url=f"{url}/v1", api_key="sekret", timeout=60, max_retries=0)
    assert authed.completions.create(model=MODEL, prompt="t5", max_tokens=1).usage.completion_tokens == 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="bad", max_retries=0).models.list()
    headers = {"Authorization": "Bearer sekret"}
    assert wait_settled(url, headers)["kvrelay_kv_blocks_in_use"] == 0


# ----------------------------------------------------------------------------------- engine failure
def test_a_crashed_engine_fails_requests_and_health_says_unhealthy():
    from fastapi.testclient import TestClient

    from kvrelay import LLM
    from kvrelay.engine.async_llm import AsyncLLM
    from kvrelay.entrypoints.openai_server import build_app
    from tests.tiny import tiny_loaded_model

    engine = LLM(loaded_model=tiny_loaded_model(), num_blocks=32, block_size=4).engine

    def broken_step():
        raise RuntimeError("simulated device fault")

    engine.step = broken_step  # type: ignore[method-assign]
    async_llm = AsyncLLM(engine)
    try:
        with TestClient(build_app(async_llm, "tiny")) as http:
            assert http.get("/health").status_code == 200
            failed = http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
            assert failed.status_code == 500 and "simulated device fault" in failed.json()["error"]["message"]
            health = http.get("/health")
            assert health.status_code == 503 and "simulated device fault" in health.json()["reason"]
            refused = http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
            assert refused.status_code == 503
    finally:
        async_llm.shutdown()

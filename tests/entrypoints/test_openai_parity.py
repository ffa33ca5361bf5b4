"""OpenAI / vLLM API parity of `kvrelay serve` (a real process on loopback): n > 1, prompt lists,
echo, /tokenize, /detokenize, /version, /openapi.json and /docs, and the usage and /metrics
counts for all of them."""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import openai
import pytest

from tests.entrypoints.test_openai_server import (
    ABORTED,
    IGNORE_EOS,
    MODEL,
    _start,
    metrics,
    post,
    wait_settled,
)
from tests.tiny import write_tiny_model_dir

pytestmark = pytest.mark.timeout(180)

BLOCK = 4  # the server's --block-size
SAMPLED = {"temperature": 1.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = write_tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny-llama")
    proc = _start(model_dir, tmp_path_factory.mktemp("logs") / "serve.log")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60, max_retries=0)


def finished(m: dict[str, float], reason: str) -> float:
    return m.get(f'kvrelay_requests_finished_total{{finish_reason="{reason}"}}', 0.0)


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after[f"kvrelay_{name}_total"] - before[f"kvrelay_{name}_total"]


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: {")]


# ----------------------------------------------------------------------------------- n > 1
def test_n_choices_with_the_openai_client_count_the_prompt_once(client, server):
    before = wait_settled(server.url)
    prompt = [101, 102, 103, 104, 105, 106, 107, 108, 109]  # 9 tokens: 2 full blocks + 1
    resp = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=4, seed=11,
                                     extra_body=IGNORE_EOS, **SAMPLED)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and len(c.text.split()) == 4 for c in resp.choices)
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (9, 12, 21)
    after = wait_settled(server.url)
    # The prompt ran once; each sibling computed only its last token (the hit covers 2 blocks).
    assert delta(after, before, "prompt_tokens_computed") == 9 + 2 * 1
    assert delta(after, before, "prompt_tokens_cached") == 2 * 8
    assert delta(after, before, "generation_tokens") == 12
    assert finished(after, "length") - finished(before, "length") == 3  # one per choice
    assert after["kvrelay_kv_blocks_in_use"] == 0


def test_seeded_choices_are_reproducible_and_differ(client):
    kwargs = dict(model=MODEL, prompt="t40 t41", n=3, max_tokens=10, seed=5, extra_body=IGNORE_EOS, **SAMPLED)
    first = [c.text for c in client.completions.create(**kwargs).choices]
    assert first == [c.text for c in client.completions.create(**kwargs).choices]
    assert len(set(first)) == 3


def test_chat_with_n_choices(client):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t5 t6"}], n=2,
                                          max_tokens=3, seed=1, extra_body=IGNORE_EOS, **SAMPLED)
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.message.role == "assistant" and len(c.message.content.split()) == 3 for c in resp.choices)
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (6, 6)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_streaming_n_interleaves_choices_that_assemble_to_the_unstreamed_ones(client, route):
    kwargs = dict(model=MODEL, n=3, max_tokens=8, seed=9, extra_body=IGNORE_EOS, **SAMPLED)
    if route == "chat":
        create = client.chat.completions.create
        kwargs["messages"] = [{"role": "user", "content": "t7 t8"}]
        full = [c.message.content for c in create(**kwargs).choices]

        def piece(choice):
            return choice.delta.content or ""
    else:
        create = client.completions.create
        kwargs["prompt"] = "t7 t8 t9"
        full = [c.text for c in create(**kwargs).choices]

        def piece(choice):
            return choice.text
    texts: dict[int, str] = defaultdict(str)
    reasons: dict[int, str] = {}
    order = []
    chunks = list(create(stream=True, stream_options={"include_usage": True}, **kwargs))
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += piece(choice)
            order.append(choice.index)
            if choice.finish_reason:
                assert choice.index not in reasons  # one final chunk per choice
                reasons[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(3)] == full
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert order != sorted(order)  # interleaved as the tokens came, not choice after choice
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 24


def test_client_disconnect_mid_stream_aborts_every_choice(server):
    before = metrics(server.url)
    body = {"prompt": "t60 t61", "n": 3, "max_tokens": 300, "stream": True, **IGNORE_EOS, **SAMPLED}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break
    after = wait_settled(server.url)
    assert after["kvrelay_kv_blocks_in_use"] == 0
    assert delta(after, before, "generation_tokens") < 900
    assert after[ABORTED] - before.get(ABORTED, 0) == 3


# ----------------------------------------------------------------------------------- prompt lists
def test_a_list_of_prompts_gives_one_choice_per_prompt_in_order(client):
    greedy = dict(model=MODEL, max_tokens=5, temperature=0.0, extra_body=IGNORE_EOS)
    prompts = ["t11 t12", "t13", "t14 t15 t16"]
    alone = [client.completions.create(prompt=p, **greedy).choices[0].text for p in prompts]
    resp = client.completions.create(prompt=prompts, **greedy)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == alone
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (6, 15)
    ids = client.completions.create(prompt=[[11, 12], [13]], **greedy)
    assert [c.text for c in ids.choices] == alone[:2]


def test_a_list_of_prompts_times_n_indexes_choice_k_n_plus_j(server):
    body = {"prompt": [[21, 22], [23, 24, 25]], "n": 2, "max_tokens": 3, "seed": 4, **IGNORE_EOS, **SAMPLED}
    resp = post(server.url, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    single = post(server.url, "/v1/completions", {**body, "prompt": [23, 24, 25]}).json()["choices"]
    assert [c["text"] for c in choices[2:]] == [c["text"] for c in single]  # prompt 1, seeds s, s+1
    assert resp.json()["usage"]["prompt_tokens"] == 5 and resp.json()["usage"]["completion_tokens"] == 12


def test_a_streamed_list_of_prompts_interleaves_and_ends_with_the_usage(server):
    body = {"prompt": ["t31 t32", "t33"], "n": 2, "max_tokens": 4, "stream": True, "seed": 3,
            "stream_options": {"include_usage": True}, **IGNORE_EOS, **SAMPLED}
    resp = post(server.url, "/v1/completions", body)
    assert resp.status_code == 200 and resp.text.rstrip().endswith("data: [DONE]")
    events = sse_events(resp.text)
    texts: dict[int, str] = defaultdict(str)
    for event in events[:-1]:
        assert event["id"] == events[0]["id"] and event["usage"] is None
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    full = post(server.url, "/v1/completions", {**body, "stream": False, "stream_options": None}).json()
    assert [texts[i] for i in range(4)] == [c["text"] for c in full["choices"]]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 16
    assert events[-1]["usage"]["prompt_tokens"] == 3


def test_metrics_count_each_prompt_of_a_list(server):
    before = wait_settled(server.url)
    body = {"prompt": [[201, 202, 203], [204, 205, 206, 207, 208]], "max_tokens": 2, "temperature": 0.0,
            **IGNORE_EOS}
    assert post(server.url, "/v1/completions", body).status_code == 200
    after = wait_settled(server.url)
    assert delta(after, before, "prompt_tokens_computed") == 8
    assert delta(after, before, "generation_tokens") == 4
    assert finished(after, "length") - finished(before, "length") == 2
    assert after["kvrelay_time_to_first_token_seconds_count"] - before[
        "kvrelay_time_to_first_token_seconds_count"] == 2


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server):
    body = {"prompt": "t5", "max_tokens": 3, "stream": True, "temperature": 0.0, **IGNORE_EOS,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = sse_events(post(server.url, "/v1/completions", body).text)
    counts = [e["usage"]["completion_tokens"] for e in events[:-1]]
    assert counts == sorted(counts) and counts[-1] == 3 and events[-1]["usage"]["completion_tokens"] == 3


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    body = {"prompt": [5] * 600 + [6, 7], "max_tokens": 2, "temperature": 0.0, **IGNORE_EOS}
    kept = post(server.url, "/v1/completions", {**body, "truncate_prompt_tokens": 3}).json()
    assert kept["usage"]["prompt_tokens"] == 3
    alone = post(server.url, "/v1/completions", {**body, "prompt": [5, 6, 7]}).json()
    assert kept["choices"][0]["text"] == alone["choices"][0]["text"]
    fitted = post(server.url, "/v1/completions", {**body, "truncate_prompt_tokens": -1}).json()
    assert fitted["usage"]["prompt_tokens"] == 512 - 2  # all that leave room for max_tokens


# ----------------------------------------------------------------------------------- echo
def test_echo_prepends_the_prompt_streamed_and_not(client):
    kwargs = dict(model=MODEL, max_tokens=3, temperature=0.0, extra_body=IGNORE_EOS)
    plain = client.completions.create(prompt="t1 t2", **kwargs).choices[0].text
    echoed = client.completions.create(prompt="t1 t2", echo=True, **kwargs)
    assert echoed.choices[0].text == "t1 t2" + plain
    assert echoed.usage.completion_tokens == 3
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt="t1 t2", echo=True,
                                                                             stream=True, **kwargs))
    assert streamed == "t1 t2" + plain
    ids = client.completions.create(prompt=[1, 2], echo=True, **kwargs).choices[0].text
    assert ids == "t1 t2" + plain  # token ids are decoded for the echo


def test_echo_with_max_tokens_0_returns_the_prompt_alone(client):
    resp = client.completions.create(model=MODEL, prompt=["t3 t4", "t5"], echo=True, max_tokens=0)
    assert [c.text for c in resp.choices] == ["t3 t4", "t5"]
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (3, 0)


def test_chat_echo_continues_the_last_message_of_the_replying_role(server):
    body = {"messages": [{"role": "user", "content": "t5"}, {"role": "assistant", "content": "t8 t9"}],
            "echo": True, "max_tokens": 2, "temperature": 0.0, **IGNORE_EOS}
    resp = post(server.url, "/v1/chat/completions", body).json()
    plain = post(server.url, "/v1/chat/completions", {**body, "echo": False}).json()
    assert resp["choices"][0]["message"]["content"] == "t8 t9" + plain["choices"][0]["message"]["content"]
    user_last = {**body, "messages": body["messages"][:1]}
    assert post(server.url, "/v1/chat/completions", user_last).json()["choices"][0]["message"]["content"] \
        == post(server.url, "/v1/chat/completions", {**user_last, "echo": False}).json()[
            "choices"][0]["message"]["content"]  # the reply's role differs: nothing to echo
    events = sse_events(post(server.url, "/v1/chat/completions", {**body, "stream": True}).text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "t8 t9"}


# ----------------------------------------------------------------------------------- other routes
def test_tokenize_a_prompt_and_messages_and_detokenize_back(server):
    resp = post(server.url, "/tokenize", {"prompt": "t5 t6 t7", "return_token_strs": True})
    assert resp.status_code == 200
    assert resp.json() == {"count": 3, "max_model_len": 512, "tokens": [5, 6, 7],
                           "token_strs": ["t5", "t6", "t7"]}
    chat = post(server.url, "/tokenize", {"messages": [{"role": "user", "content": "t5 t6 t7"}]}).json()
    assert chat["count"] == 7 and chat["tokens"][2:5] == [5, 6, 7]  # what the chat route counts as prompt
    back = post(server.url, "/detokenize", {"tokens": [5, 6, 7], "model": MODEL})
    assert back.status_code == 200 and back.json() == {"prompt": "t5 t6 t7"}


def test_version_openapi_and_docs(server):
    import kvrelay

    assert httpx.get(f"{server.url}/version", timeout=5).json() == {"version": kvrelay.__version__}
    spec = httpx.get(f"{server.url}/openapi.json", timeout=5).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/version"):
        assert path in spec["paths"], path
    docs = httpx.get(f"{server.url}/docs", timeout=5)
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_everything_settles_to_zero_blocks(server):
    assert wait_settled(server.url)["kvrelay_kv_blocks_in_use"] == 0

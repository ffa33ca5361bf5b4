"""KvrelayPushConnector in real `vllm serve` processes: the same adapter as the pull, with kvrelay's
push (P writes each layer into D's blocks from save_kv_layer, during its own forward) behind
kvrelay's proxy in push mode (D's leg first)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvrelay.disagg.proxy import ProxyConfig, build_app
from tests.disagg.servers import ServerThread
from tests.entrypoints.serve_process import free_port
from tests.integrations.vllm.helpers import answer, connector_config, metric, prompt_set, vllm_args, wait_for
from tests.vllm_serve import VllmServer


@pytest.fixture(scope="module")
def push_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer, int]]:
    log_dir = tmp_path_factory.mktemp("vllm-push")
    kv_port = free_port()
    p_config = connector_config("KvrelayPushConnector", "kv_producer", port=kv_port)
    d_config = connector_config("KvrelayPushConnector", "kv_consumer")
    p = VllmServer(log_dir / "p.log", *vllm_args(p_config), core=0)
    d = VllmServer(log_dir / "d.log", *vllm_args(d_config, "--no-enable-prefix-caching"), core=1)
    with p, d:
        p.wait_healthy()
        d.wait_healthy()
        yield p, d, kv_port


def test_pushed_prompts_equal_one_vllm_instance_and_d_loads_them(
        push_pair: tuple[VllmServer, VllmServer, int]) -> None:
    p, d, kv_port = push_pair
    prompts = prompt_set(40, lengths=(300, 900, 1500))
    alone = [answer(p.url, prompt) for prompt in prompts]
    external = metric(d.url, "vllm:external_prefix_cache_hits_total")
    config = ProxyConfig(prefill_urls=(p.url,), decode_urls=(d.url,), transfer_mode="push",
                         prefill_kv_addresses=(f"127.0.0.1:{kv_port}",))
    with ServerThread(build_app(config)) as proxy:
        assert [answer(proxy.url, prompt) for prompt in prompts] == alone
    assert metric(d.url, "vllm:external_prefix_cache_hits_total") - external == sum(len(x) for x in prompts)
    assert metric(p.url, "vllm:kvrelay_push_bytes_saved_total") > 0
    for server in (p, d):
        wait_for(lambda s=server: metric(s.url, "vllm:kv_cache_usage_perc") == 0, 30, f"{server.url} freeing")

"""What the proxy learns of an instance at join (GET /v1/models), and the refusal of an instance
whose transfer mode is not the proxy's: at start, through the admin API, and when one that was
down at start first answers. Over fake backends; tests/disagg/test_up_push.py does the same
against real `kvrelay serve` instances."""

from __future__ import annotations

import asyncio
from contextlib import ExitStack
from typing import Any

import pytest

from kvrelay.disagg.instance_info import TransferModeError
from kvrelay.disagg.pool_manager import check_instances
from kvrelay.disagg.proxy import ProxyConfig, build_app
from kvrelay.entrypoints.cli import main
from tests.disagg.servers import FakeBackend, ServerThread, closed_port_url
from tests.disagg.test_pool_admin import KEY, admin, chat, members, pool
from tests.kv_transfer.transport.helpers import wait_for

PUSH = {"kv_connector": "NixlPushConnector", "kv_role": "kv_both", "transfer_mode": "push"}
PULL = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "transfer_mode": "pull"}


def backends(kv_transfer: dict[str, Any] | None) -> tuple[FakeBackend, FakeBackend]:
    return FakeBackend("P", kv_transfer=kv_transfer), FakeBackend("D", kv_transfer=kv_transfer)


# the hand-built app's refusal ends uvicorn's thread with SystemExit(3), as it ends the process
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_pull_proxy_refuses_to_start_before_push_instances_naming_both_modes_and_the_flag(
        capsys: pytest.CaptureFixture[str]) -> None:
    p, d = backends(PUSH)
    with ExitStack() as stack:
        p_url, d_url = (stack.enter_context(ServerThread(b.app())).url for b in (p, d))
        config = ProxyConfig(prefill_urls=(p_url,), decode_urls=(d_url,))
        with pytest.raises(TransferModeError) as refused:
            asyncio.run(check_instances(config))
        with pytest.raises(RuntimeError, match="did not start"), ServerThread(build_app(config)):
            pass  # the app built by hand refuses too
        free_port = closed_port_url().rsplit(":", 1)[1]
        assert main(["proxy", "--prefill", p_url, "--decode", d_url, "--port", free_port]) == 2
    message = str(refused.value)
    assert message.startswith(f"the prefill instance {p_url} runs NixlPushConnector (transfer mode push) and "
                              f"the decode instance {d_url} runs NixlPushConnector (transfer mode push), but "
                              "this proxy runs transfer mode pull")
    assert message.endswith("start the proxy with --transfer-mode push --prefill-kv HOST:PORT (each prefill "
                            "instance's kv_ip:kv_port)")
    assert capsys.readouterr().err.splitlines()[-1] == f"kvrelay: error: {message}"
    assert p.requests == [] and d.requests == []


def test_a_push_proxy_refuses_pull_instances_and_vllm_instances_are_never_refused() -> None:
    p, d = backends(PULL)
    vllm_p, vllm_d = backends(None)  # vLLM's card says nothing about its connector
    with ExitStack() as stack:
        urls = [stack.enter_context(ServerThread(b.app())).url for b in (p, d, vllm_p, vllm_d)]
        push = {"transfer_mode": "push", "prefill_kv_addresses": ("127.0.0.1:5600",)}
        pulling = ProxyConfig(prefill_urls=(urls[0],), decode_urls=(urls[1],), **push)
        with pytest.raises(TransferModeError, match=r"start the proxy with --transfer-mode pull \(the"):
            asyncio.run(check_instances(pulling))
        for mode in ({}, push):
            asyncio.run(check_instances(ProxyConfig(prefill_urls=(urls[2],), decode_urls=(urls[3],), **mode)))


def test_the_admin_api_refuses_an_instance_of_the_other_mode_with_409() -> None:
    with pool([FakeBackend("P", kv_transfer=PULL)], [FakeBackend("D", kv_transfer=PULL)]) as (url, _, stack):
        pushing = stack.enter_context(ServerThread(FakeBackend("D2", kv_transfer=PUSH).app())).url
        response = admin(url, "POST", "", {"role": "decode", "url": pushing})
        assert response.status_code == 409
        error = response.json()["error"]
        assert error["type"] == "ConflictError"
        assert error["message"].startswith(f"the decode instance {pushing} runs NixlPushConnector (transfer "
                                           "mode push), but this proxy runs transfer mode pull")
        assert "add it to a proxy started with --transfer-mode push" in error["message"]
        assert pushing not in members(url)
        pulling = stack.enter_context(ServerThread(FakeBackend("D3", kv_transfer=PULL).app())).url
        assert admin(url, "POST", "", {"role": "decode", "url": pulling}).status_code == 201


def test_an_instance_down_at_start_is_refused_when_it_first_answers(caplog: pytest.LogCaptureFixture) -> None:
    late = closed_port_url()
    d1 = FakeBackend("D1")
    with ExitStack() as stack:
        p_url, d1_url = (stack.enter_context(ServerThread(b.app())).url for b in (FakeBackend("P"), d1))
        app = build_app(ProxyConfig(prefill_urls=(p_url,), decode_urls=(d1_url, late), health_interval=0.05,
                                    admin_key=KEY))
        url = stack.enter_context(ServerThread(app)).url  # nobody at `late` says its mode: it starts
        assert late in members(url)
        port = int(late.rsplit(":", 1)[1])
        stack.enter_context(ServerThread(FakeBackend("late", kv_transfer=PUSH).app(), port=port))
        wait_for(lambda: late not in members(url), what="the push instance to be refused")
        assert chat(url).status_code == 200 and len(d1.requests) == 1
    refusals = [r for r in caplog.records if "transfer mode push" in r.getMessage()]
    assert [r.levelname for r in refusals] == ["ERROR"] and late in refusals[0].getMessage()

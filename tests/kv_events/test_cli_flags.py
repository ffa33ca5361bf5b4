"""The new flags reach the command line: --kv-events-config on serve, routing and admin flags on
proxy and up, and `kvrelay pool` refuses to run without an admin key."""

from __future__ import annotations

import pytest

from kvrelay.entrypoints.cli import build_parser, main


def test_serve_refuses_a_bad_kv_events_config_before_loading_a_model(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--kv-events-config", '{"enable_kv_cache_events": true, "bufer": 1}']) == 2
    assert "unknown kv_events_config key(s) 'bufer'" in capsys.readouterr().err


def test_proxy_and_up_take_the_routing_flags() -> None:
    parser = build_parser()
    proxy = parser.parse_args(["proxy", "--prefill", "http://a:1", "--decode", "http://b:2",
                               "--routing", "round-robin", "--decode-routing", "least-loaded",
                               "--admin-key", "k", "--health-interval", "0.5", "--model", "m.gguf"])
    assert (proxy.routing, proxy.decode_routing, proxy.admin_key, proxy.health_interval) == (
        "round-robin", "least-loaded", "k", 0.5)
    from kvrelay.disagg.proxy_cli import routing_of

    assert routing_of(proxy) == ("round-robin", "least-loaded")
    up = parser.parse_args(["up", "--prefill-routing", "least-loaded", "--admin", "--admin-port", "9000"])
    assert routing_of(up) == ("least-loaded", "kv-aware") and up.admin and up.admin_port == 9000
    with pytest.raises(SystemExit):
        parser.parse_args(["proxy", "--prefill", "http://a:1", "--decode", "http://b:2",
                           "--routing", "random"])


def test_pool_needs_an_admin_key(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("KVRELAY_ADMIN_KEY", raising=False)
    assert main(["pool", "list"]) == 2
    assert "no admin key" in capsys.readouterr().err


def test_pool_reports_an_unreachable_admin_endpoint(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from tests.disagg.servers import closed_port_url

    monkeypatch.setenv("KVRELAY_ADMIN_KEY", "k")
    assert main(["pool", "--admin-url", closed_port_url(), "list"]) == 1
    assert "did not answer" in capsys.readouterr().err

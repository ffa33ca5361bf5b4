"""The per-format KV bytes-per-token gauge on /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from kvrelay.metrics.prometheus import EngineStatsCollector


def test_bytes_per_token_gauge_is_labelled_by_format() -> None:
    registry = CollectorRegistry()
    stats = {"kv_cache_dtype": "fp8_e4m3", "kv_bytes_per_token": 5760}
    registry.register(EngineStatsCollector(lambda: stats))
    text = generate_latest(registry).decode()
    assert 'kvrelay_kv_cache_bytes_per_token{kv_cache_dtype="fp8_e4m3"} 5760.0' in text


def test_no_gauge_without_the_engine_reporting_it() -> None:
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: {}))
    assert "kvrelay_kv_cache_bytes_per_token" not in generate_latest(registry).decode()

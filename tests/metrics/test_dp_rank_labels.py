"""/metrics of a server fronting data-parallel ranks: every sample per rank, labelled dp_rank;
one engine's, unlabelled as before."""

from __future__ import annotations

from prometheus_client import generate_latest

from kvrelay.metrics.prometheus import ServerMetrics

RANK_STATS = {0: {"blocks_in_use": 3, "generation_tokens": 10, "kv_cache_dtype": "float32",
                  "kv_bytes_per_token": 1024, "kv_transfer_loopback_gbps": {"tcp:host": 1.5}},
              1: {"blocks_in_use": 0, "generation_tokens": 7, "kv_cache_dtype": "float32",
                  "kv_bytes_per_token": 1024}}


def test_every_metric_of_a_rank_carries_its_dp_rank() -> None:
    metrics = ServerMetrics(lambda: RANK_STATS[0], [(r, lambda r=r: RANK_STATS[r]) for r in (0, 1)])
    metrics.of_rank(metrics.time_to_first_token, 1).observe(0.2)
    metrics.of_rank(metrics.requests_finished, 0, "length").inc()
    metrics.stats_listener(1)({"kv_transfer_seconds": 0.0}, {"kv_transfer_seconds": 0.5})
    text = generate_latest(metrics.registry).decode()
    for line in ('kvrelay_kv_blocks_in_use{dp_rank="0"} 3.0', 'kvrelay_kv_blocks_in_use{dp_rank="1"} 0.0',
                 'kvrelay_generation_tokens_total{dp_rank="1"} 7.0',
                 'kvrelay_kv_cache_bytes_per_token{dp_rank="1",kv_cache_dtype="float32"} 1024.0',
                 'kvrelay_kv_transfer_loopback_gbps{backend="tcp",dp_rank="0",path="host"} 1.5',
                 'kvrelay_time_to_first_token_seconds_count{dp_rank="1"} 1.0',
                 'kvrelay_requests_finished_total{dp_rank="0",finish_reason="length"} 1.0',
                 'kvrelay_kv_transfer_seconds_count{dp_rank="1"} 1.0'):
        assert line in text, line
    samples = [line for line in text.splitlines() if line.startswith("kvrelay_")]
    assert samples and all('dp_rank="' in line for line in samples)


def test_one_engines_metrics_have_no_rank_label() -> None:
    metrics = ServerMetrics(lambda: RANK_STATS[0])
    metrics.of_rank(metrics.requests_finished, None, "stop").inc()
    text = generate_latest(metrics.registry).decode()
    assert "kvrelay_kv_blocks_in_use 3.0" in text
    assert 'kvrelay_requests_finished_total{finish_reason="stop"} 1.0' in text
    assert "dp_rank" not in text

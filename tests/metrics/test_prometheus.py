"""What a Prometheus scrape of kvrelay reads: no `*_created` series (vLLM 0.32 has them from one API
server, none from several; kvrelay.metrics.prometheus.new_registry says why kvrelay has none)."""

from __future__ import annotations

from kvrelay.disagg.proxy_metrics import ProxyMetrics
from kvrelay.metrics.prometheus import ServerMetrics


def series(text: str) -> set[str]:
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    return {line.split("{")[0].split(" ")[0] for line in samples}


def test_counters_and_histograms_export_no_created_series() -> None:
    server = ServerMetrics(lambda: {"prompt_tokens_computed": 3})
    server.time_to_first_token.observe(0.1)
    server.requests_finished.labels("stop").inc()
    proxy = ProxyMetrics()
    proxy.requests.labels(route="/v1/completions").inc()
    for text in (server.render()[0].decode(), proxy.render().decode()):
        names = series(text)
        assert any(name.endswith("_total") for name in names)  # counters are there
        assert [name for name in names if name.endswith("_created")] == []

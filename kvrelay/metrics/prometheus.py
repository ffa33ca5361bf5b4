"""Prometheus export for one serving instance.

Each app gets its own CollectorRegistry (never the process-global one), so several apps in one
process (tests) do not collide. Counters and gauges are read from the engine's stats snapshot
at scrape time by a custom collector; the latency histograms are observed as things happen:
TTFT and inter-token latency by the server per request, KV transfer seconds by a stats listener
running in the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Exposed name -> (stats key, help). Counter names get "_total" appended by prometheus_client.
_GAUGES = {
    "kvrelay_kv_blocks_total": ("num_blocks", "KV cache blocks in the pool."),
    "kvrelay_kv_blocks_in_use": ("blocks_in_use", "KV cache blocks referenced by requests or transfers."),
    "kvrelay_num_requests_running": ("num_running", "Requests in the running batch."),
    "kvrelay_num_requests_waiting": ("num_waiting", "Requests waiting to be scheduled."),
    "kvrelay_num_requests_waiting_for_remote_kv": (
        "num_waiting_for_remote_kv", "Requests waiting for KV cache from another instance."),
}
_COUNTERS = {
    "kvrelay_prompt_tokens_computed": ("prompt_tokens_computed", "Prompt tokens run through the model here."),
    "kvrelay_prompt_tokens_cached": ("prompt_tokens_cached", "Prompt tokens hit in the local prefix cache."),
    "kvrelay_prompt_tokens_external": ("prompt_tokens_external", "Prompt tokens loaded by a KV connector."),
    "kvrelay_generation_tokens": ("generation_tokens", "Tokens generated."),
    "kvrelay_kv_transfer_bytes": ("kv_transfer_bytes", "KV cache bytes moved by the connector."),
    "kvrelay_kv_transfer_failures": ("kv_transfer_failures", "Failed KV loads and saves."),
    "kvrelay_kv_lease_expired": ("kv_lease_expired", "Held KV blocks freed because their lease expired."),
    "kvrelay_kv_transfer_incompatible": (
        "kv_transfer_incompatible", "KV handshakes refused because the peer's KV cannot be used here "
                                    "(another model, KV format, layout or numerics, named in the log); "
                                    "D recomputed."),
    "kvrelay_kv_load_failures": ("kv_load_failures", "Requests whose KV load failed (recomputed or failed)."),
    "kvrelay_num_preemptions": ("num_preemptions", "Requests preempted for lack of KV blocks."),
}

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


StatsReader = Callable[[], dict[str, Any]]


class EngineStatsCollector(Collector):
    """Gauges and counters from the engines' latest stats snapshots: one engine's, unlabelled,
    or one per data-parallel rank, each sample labelled `dp_rank`."""

    def __init__(self, read_stats: StatsReader, ranks: Sequence[tuple[int, StatsReader]] = ()) -> None:
        self.sources: list[tuple[int | None, StatsReader]] = (
            [(dp_rank, read) for dp_rank, read in ranks] if ranks else [(None, read_stats)])

    def collect(self) -> Iterator[Metric]:
        snapshots = [(rank, read()) for rank, read in self.sources]
        rank_label = ["dp_rank"] if snapshots[0][0] is not None else []

        def labels(rank: int | None, *values: str) -> list[str]:
            return [*values, *([] if rank is None else [str(rank)])]

        for families, kind in ((_GAUGES, GaugeMetricFamily), (_COUNTERS, CounterMetricFamily)):
            for name, (key, help_text) in families.items():
                family = kind(name, help_text, labels=rank_label)
                for rank, stats in snapshots:
                    family.add_metric(labels(rank), float(stats.get(key, 0)))
                yield family
        per_token = GaugeMetricFamily(
            "kvrelay_kv_cache_bytes_per_token",
            "KV cache bytes per token over all layers (what a transfer moves per token), by format.",
            labels=["kv_cache_dtype", *rank_label])
        gauge = GaugeMetricFamily(
            "kvrelay_kv_transfer_loopback_gbps",
            "GB/s of the start-up loopback transfer on the KV device, by backend and the path it took.",
            labels=["backend", "path", *rank_label])
        for rank, stats in snapshots:
            if "kv_bytes_per_token" in stats:
                per_token.add_metric(labels(rank, str(stats.get("kv_cache_dtype", ""))),
                                     float(stats["kv_bytes_per_token"]))
            for label, gbps in sorted((stats.get("kv_transfer_loopback_gbps") or {}).items()):
                backend, _, path = label.partition(":")
                gauge.add_metric(labels(rank, backend, path), float(gbps))
        for family in (per_token, gauge):
            if family.samples:
                yield family


def new_registry(auto_describe: bool = False) -> CollectorRegistry:
    """A registry of one app. Counters and histograms export no `*_created` series (a creation
    timestamp per series, which no dashboard reads and every scrape stores). vLLM 0.32 exports
    them from one API server (53 of its 445 series, checked in .venv-vllm) and none from several
    (its multiprocess collector has none). NOTE: prometheus_client's switch is process-wide;
    every kvrelay app wants it off."""
    disable_created_metrics()
    return CollectorRegistry(auto_describe=auto_describe)


class ServerMetrics:
    """The metrics of one `kvrelay serve` app. With `ranks` (data parallelism: (dp_rank, stats)
    per rank) every metric carries a `dp_rank` label; the per-request ones take the rank that
    served the request."""

    def __init__(self, read_stats: StatsReader, ranks: Sequence[tuple[int, StatsReader]] = ()) -> None:
        self.registry = new_registry(auto_describe=True)
        self.registry.register(EngineStatsCollector(read_stats, ranks))
        rank_label = ["dp_rank"] if ranks else []
        self.time_to_first_token = Histogram(
            "kvrelay_time_to_first_token_seconds", "From request arrival to its first output token.",
            rank_label, buckets=_TTFT_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram(
            "kvrelay_inter_token_latency_seconds", "Between consecutive output tokens of a request.",
            rank_label, buckets=_ITL_BUCKETS, registry=self.registry)
        self.kv_transfer_seconds = Histogram(
            "kvrelay_kv_transfer_seconds",
            "Seconds the KV connector spent loading and saving, one sample per engine step that moved KV.",
            rank_label, buckets=_TRANSFER_BUCKETS, registry=self.registry)
        self.requests_finished = Counter(
            "kvrelay_requests_finished", "Requests finished, by finish reason.",
            ["finish_reason", *rank_label], registry=self.registry)

    def of_rank(self, metric: Any, dp_rank: int | None, *labels: str) -> Any:
        """`metric`'s child for `labels` and, under data parallelism, the rank that served."""
        values = [*labels, *([] if dp_rank is None else [str(dp_rank)])]
        return metric.labels(*values) if values else metric

    def stats_listener(self, dp_rank: int | None = None) -> Callable[[dict[str, Any], dict[str, Any]], None]:
        """A stats listener for one engine's AsyncLLM (it runs in the engine thread; Histogram is
        thread-safe): KV transfer seconds, per step that moved KV."""
        histogram = self.of_rank(self.kv_transfer_seconds, dp_rank)

        def on_engine_stats(previous: dict[str, Any], current: dict[str, Any]) -> None:
            key = "kv_transfer_seconds"
            moved = float(current.get(key, 0.0)) - float(previous.get(key, 0.0))
            if moved > 0:
                histogram.observe(moved)
        return on_engine_stats

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

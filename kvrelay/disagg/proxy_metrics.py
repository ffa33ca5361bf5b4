"""The proxy's Prometheus metrics, in a registry of its own (never the process-global one)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvrelay.disagg.routing.kv_index import HASHES_NOT_REPRODUCIBLE
from kvrelay.metrics.prometheus import new_registry

if TYPE_CHECKING:
    from kvrelay.disagg.pool_manager import PoolManager


class ProxyMetrics:
    """Counters of legs, fallbacks, errors and routing decisions, served at the proxy's /metrics.

    kvrelay_proxy_requests_total{route}                client requests received
    kvrelay_proxy_legs_total{leg, backend, outcome}    prefill legs: ok | fallback | final (P's
                                                       token ended the answer: no decode leg) |
                                                       client_error (P refused what the client
                                                       sent); decode legs: ok | error | cancelled
    kvrelay_proxy_client_errors_total{by, status}      requests answered with a client error and
                                                       no decode leg: P's refusal (by="prefill"), or
                                                       the proxy's context check (by="proxy")
    kvrelay_proxy_fallbacks_total{reason}              requests decoded on D alone, by why:
                                                       unreachable | timeout | http_<status> |
                                                       bad_response | no_kv_transfer_params |
                                                       no_prefill_instance
    kvrelay_proxy_errors_total{kind}                   bad_request, decode_unreachable,
                                                       decode_http_<status>, client_disconnected, ...
    kvrelay_proxy_prefill_seconds                      duration of the prefill leg
    kvrelay_proxy_backend_up{backend}                  1 if the backend's last /health was 200
    kvrelay_proxy_marked_down_total{role, backend, reason}
                                                       instances taken out of routing, by why:
                                                       unreachable | disconnected | timeout |
                                                       http_<status> (docs/routing.md)
    kvrelay_proxy_stale_connection_retries_total{backend}
                                                       requests sent again on a fresh connection
                                                       after a reused one proved stale
    kvrelay_proxy_routing_decisions_total{role, policy, reason}
                                                       each leg's choice, by why (routing/policies.py)
    kvrelay_proxy_prefix_hit_tokens_total{kind}        prefill legs' prompt tokens cached on the
                                                       chosen P: predicted by the index, and actual
                                                       (P's usage.prompt_tokens_details.cached_tokens)
    kvrelay_proxy_prefix_predictions_total{outcome}    per prefill leg: exact | over | under
    kvrelay_proxy_pool_instances{role, state}          members by role and state
    kvrelay_proxy_kv_index_usable{backend}             1 while kv-aware routing trusts its index
    kvrelay_proxy_kv_hashes_reproducible{backend, scheme}  1 while the proxy computes the instance's
                                                       block hashes (its scheme: kvrelay, vllm sha256,
                                                       ...), 0 once its events matched none
    kvrelay_proxy_kv_index_seconds_since_event{backend}  age of its newest KV event batch
    kvrelay_proxy_kv_index_blocks{backend, medium}     blocks its index holds
    kvrelay_proxy_kv_events_batches_total{backend}     event batches received
    kvrelay_proxy_kv_events_lost_total{backend}        batches lost for good (fell behind)
    kvrelay_proxy_kv_index_resets_total{backend}       times its index restarted empty
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = new_registry()
        self.requests = Counter("kvrelay_proxy_requests", "Client requests received",
                                ["route"], registry=self.registry)
        self.legs = Counter("kvrelay_proxy_legs", "Legs sent to backends, by outcome",
                            ["leg", "backend", "outcome"], registry=self.registry)
        self.fallbacks = Counter("kvrelay_proxy_fallbacks",
                                 "Requests decoded without a usable prefill leg, by reason",
                                 ["reason"], registry=self.registry)
        self.errors = Counter("kvrelay_proxy_errors", "Errors seen by the proxy, by kind",
                              ["kind"], registry=self.registry)
        self.client_errors = Counter("kvrelay_proxy_client_errors",
                                     "Requests answered with a client error and no decode leg",
                                     ["by", "status"], registry=self.registry)
        self.prefill_seconds = Histogram(
            "kvrelay_proxy_prefill_seconds", "Duration of the prefill leg", registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.backend_up = Gauge("kvrelay_proxy_backend_up", "1 if the backend's last /health was 200",
                                ["backend"], registry=self.registry)
        self.stale_retries = Counter("kvrelay_proxy_stale_connection_retries",
                                     "Requests sent again on a fresh connection after a stale reused one",
                                     ["backend"], registry=self.registry)
        self.decisions = Counter("kvrelay_proxy_routing_decisions", "Routing decisions, by reason",
                                 ["role", "policy", "reason"], registry=self.registry)
        self.prefix_hit_tokens = Counter("kvrelay_proxy_prefix_hit_tokens",
                                         "Prompt tokens cached on the chosen prefill instance",
                                         ["kind"], registry=self.registry)
        self.prefix_predictions = Counter("kvrelay_proxy_prefix_predictions",
                                          "Prefill legs whose predicted prefix hit was exact, over, under",
                                          ["outcome"], registry=self.registry)

    def observe_prefix_hit(self, predicted: int, actual: int) -> None:
        self.prefix_hit_tokens.labels(kind="predicted").inc(predicted)
        self.prefix_hit_tokens.labels(kind="actual").inc(actual)
        outcome = "exact" if predicted == actual else "over" if predicted > actual else "under"
        self.prefix_predictions.labels(outcome=outcome).inc()

    def watch_pools(self, manager: PoolManager) -> None:
        self.registry.register(PoolCollector(manager))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PoolCollector(Collector):
    """The pools and the KV index, read at scrape time."""

    def __init__(self, manager: PoolManager) -> None:
        self.manager = manager

    def collect(self) -> Iterable[Metric]:
        yield self._pool_sizes()
        yield self._mark_downs()
        if self.manager.index is not None and self.manager.subscriber is not None:
            yield from self._index_metrics()

    def _pool_sizes(self) -> Metric:
        sizes = GaugeMetricFamily("kvrelay_proxy_pool_instances", "Pool members by role and state",
                                  labels=["role", "state"])
        for role, pool in self.manager.pools.items():
            for state in ("active", "down", "draining"):
                sizes.add_metric([role, state], sum(b.state.value == state for b in pool.backends))
        return sizes

    def _mark_downs(self) -> Metric:
        downs = CounterMetricFamily("kvrelay_proxy_marked_down", "Instances taken out of routing, by reason",
                                    labels=["role", "backend", "reason"])
        for (role, url, reason), count in self.manager.downs.items():
            downs.add_metric([role, url, reason], count)
        return downs

    def _index_metrics(self) -> Iterable[Metric]:
        index, subscriber = self.manager.index, self.manager.subscriber
        assert index is not None and subscriber is not None
        usable = GaugeMetricFamily("kvrelay_proxy_kv_index_usable",
                                   "1 while kv-aware routing trusts the instance's index", labels=["backend"])
        reproducible = GaugeMetricFamily("kvrelay_proxy_kv_hashes_reproducible",
                                         "1 while the proxy computes the instance's block hashes",
                                         labels=["backend", "scheme"])
        age = GaugeMetricFamily("kvrelay_proxy_kv_index_seconds_since_event",
                                "Seconds since the instance's newest KV event batch", labels=["backend"])
        blocks = GaugeMetricFamily("kvrelay_proxy_kv_index_blocks", "Blocks the index holds",
                                   labels=["backend", "medium"])
        batches = CounterMetricFamily("kvrelay_proxy_kv_events_batches", "KV event batches received",
                                      labels=["backend"])
        lost = CounterMetricFamily("kvrelay_proxy_kv_events_lost", "KV event batches lost for good",
                                   labels=["backend"])
        resets = CounterMetricFamily("kvrelay_proxy_kv_index_resets", "Times the index restarted empty",
                                     labels=["backend"])
        streams = subscriber.stats()
        now = time.monotonic()
        for backend in self.manager.members():
            status = index.status(backend.url)
            usable.add_metric([backend.url], 1.0 if status.usable else 0.0)
            reproducible.add_metric([backend.url, status.scheme],
                                    0.0 if status.hashes == HASHES_NOT_REPRODUCIBLE else 1.0)
            for medium, count in status.blocks.items():
                blocks.add_metric([backend.url, medium], count)
            resets.add_metric([backend.url], status.resets)
            stream = streams.get(backend.url)
            if stream is not None:
                batches.add_metric([backend.url], stream.batches)
                lost.add_metric([backend.url], stream.lost)
                if stream.last_batch_at is not None:
                    age.add_metric([backend.url], now - stream.last_batch_at)
        yield from (usable, reproducible, age, blocks, batches, lost, resets)

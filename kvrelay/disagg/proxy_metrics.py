"""The proxy's Prometheus metrics, in a registry of its own (never the process-global one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class ProxyMetrics:
    """Counters of legs, fallbacks and errors, served at the proxy's /metrics.

    kvrelay_proxy_requests_total{route}                client requests received
    kvrelay_proxy_legs_total{leg, backend, outcome}    prefill legs: ok | fallback;
                                                       decode legs: ok | error | cancelled
    kvrelay_proxy_fallbacks_total{reason}              requests decoded on D alone, by why:
                                                       unreachable | timeout | http_<status> |
                                                       bad_response | no_kv_transfer_params
    kvrelay_proxy_errors_total{kind}                   bad_request, decode_unreachable,
                                                       decode_http_<status>, client_disconnected, ...
    kvrelay_proxy_prefill_seconds                      duration of the prefill leg
    kvrelay_proxy_backend_up{backend}                  1 if the backend's last /health was 200
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kvrelay_proxy_requests", "Client requests received",
                                ["route"], registry=self.registry)
        self.legs = Counter("kvrelay_proxy_legs", "Legs sent to backends, by outcome",
                            ["leg", "backend", "outcome"], registry=self.registry)
        self.fallbacks = Counter("kvrelay_proxy_fallbacks",
                                 "Requests decoded without a usable prefill leg, by reason",
                                 ["reason"], registry=self.registry)
        self.errors = Counter("kvrelay_proxy_errors", "Errors seen by the proxy, by kind",
                              ["kind"], registry=self.registry)
        self.prefill_seconds = Histogram(
            "kvrelay_proxy_prefill_seconds", "Duration of the prefill leg", registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.backend_up = Gauge("kvrelay_proxy_backend_up", "1 if the backend's last /health was 200",
                                ["backend"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

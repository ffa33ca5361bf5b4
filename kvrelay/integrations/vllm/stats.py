"""kvrelay's connector statistics in vLLM's metrics: its log line and its Prometheus /metrics.

A worker's kvrelay stats (a flat dict of numbers, summed across steps and workers: see
kvrelay/kv_transfer/base.py) travel as `KvrelayConnectorStats`; vLLM's front end rebuilds them
with the connector class's `build_kv_connector_stats` and hands them to `KvrelayPromMetrics`,
which counts each key as `vllm:kvrelay_<kind>_<key>_total` (kind: pull, push, offload), e.g.
`vllm:kvrelay_pull_bytes_loaded_total`, `vllm:kvrelay_offload_cpu_hits_total`. Counters are
created the first time their key is reported, so every key a connector counts is exported. The
start-up loopback measurement of a P2P transport is a gauge,
`vllm:kvrelay_<kind>_loopback_gbps{backend,path}`. Names carry the kind, so two kvrelay
connectors under one MultiConnector never register the same metric.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvrelay.kv_transfer.base import add_stats

LOOPBACK_PREFIX = "loopback_gbps:"  # "loopback_gbps:{backend}:{path}:{tp_rank}", a gauge
_NOT_NAME = re.compile(r"[^a-zA-Z0-9_]")


@dataclass
class KvrelayConnectorStats(KVConnectorStats):
    """A kvrelay connector's stats dict as vLLM carries connector stats (`data`)."""

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        gauges = {k: v for k, v in other.data.items() if k.startswith(LOOPBACK_PREFIX)}
        add_stats(self.data, {k: v for k, v in other.data.items() if k not in gauges})
        self.data.update(gauges)  # a measurement, not a count: the latest one stands
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: round(float(value), 3) for key, value in sorted(self.data.items())
                if isinstance(value, int | float)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvrelayPromMetrics(KVConnectorPromMetrics):
    """Counters (and the loopback gauge) of one kvrelay connector kind, per vLLM engine."""

    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]], kind: str) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.kind = kind
        self._counters: dict[str, dict[int, Any]] = {}
        self._loopback: Any = None

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            if key.startswith(LOOPBACK_PREFIX):
                self._observe_loopback(key, float(value), engine_idx)
            elif value > 0:
                self._counter(key)[engine_idx].inc(value)

    def metric_name(self, key: str) -> str:
        """`vllm:kvrelay_<kind>_<key>` (an offload key's own "offload_" dropped)."""
        if self.kind == "offload" and key.startswith("offload_"):
            key = key[len("offload_"):]
        return f"vllm:kvrelay_{self.kind}_{_NOT_NAME.sub('_', key)}"

    def _counter(self, key: str) -> dict[int, Any]:
        counters = self._counters.get(key)
        if counters is None:
            counter = self._counter_cls(name=self.metric_name(key), labelnames=self._labelnames,
                                        documentation=f"kvrelay {self.kind} connector: {key} (summed).")
            counters = self._counters[key] = create_metric_per_engine(counter, self.per_engine_labelvalues)
        return counters

    def _observe_loopback(self, key: str, gbps: float, engine_idx: int) -> None:
        _, backend, path, _rank = (key.split(":") + ["", "", ""])[:4]
        if self._loopback is None:
            self._loopback = self._gauge_cls(
                name=f"vllm:kvrelay_{self.kind}_loopback_gbps",
                labelnames=[*self._labelnames, "backend", "path"],
                documentation="GB/s of the transport's start-up loopback transfer, by backend and path.")
        labels = [*self.per_engine_labelvalues.get(engine_idx, []), backend, path]
        self._loopback.labels(*labels).set(gbps)

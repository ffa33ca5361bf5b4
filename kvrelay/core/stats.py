"""Scheduler-side counters: where prompt tokens came from, and what the connectors moved."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SchedulerStats:
    prompt_tokens_computed: int = 0  # prompt tokens run through the model on this instance
    prompt_tokens_cached: int = 0  # served from the local prefix cache
    prompt_tokens_external: int = 0  # loaded through a KV connector
    prompt_tokens_external_by_connector: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    generation_tokens: int = 0
    num_preemptions: int = 0
    kv_load_failures: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_failures: int = 0
    kv_lease_expired: int = 0
    kv_transfer_incompatible: int = 0  # handshakes refused: the peer's KV cannot be used here
    # "backend:path" -> GB/s of the start-up loopback check (the slowest rank's)
    kv_transfer_loopback_gbps: dict[str, float] = field(default_factory=dict)

    def absorb_connector_stats(self, stats: dict[str, Any]) -> None:
        """Fold one step's worker-side connector stats in (keys as in kvrelay.kv_transfer.base:
        bytes_loaded, bytes_saved, seconds_loading, seconds_saving, load_failures,
        save_failures; lease_expired for connectors with leases; handshakes_incompatible for the
        P2P connectors)."""
        if not stats:
            return
        self.kv_transfer_bytes += int(stats.get("bytes_loaded", 0)) + int(stats.get("bytes_saved", 0))
        self.kv_transfer_seconds += float(stats.get("seconds_loading", 0.0)) + float(
            stats.get("seconds_saving", 0.0))
        self.kv_transfer_failures += int(stats.get("load_failures", 0)) + int(stats.get("save_failures", 0))
        self.kv_lease_expired += int(stats.get("lease_expired", 0))
        self.kv_transfer_incompatible += int(stats.get("handshakes_incompatible", 0))
        for key, value in stats.items():
            if key.startswith("loopback_gbps:"):  # "loopback_gbps:{backend}:{path}:{tp_rank}"
                label = key.split(":", 1)[1].rsplit(":", 1)[0]
                known = self.kv_transfer_loopback_gbps.get(label, float("inf"))
                self.kv_transfer_loopback_gbps[label] = min(known, float(value))

    def add_external(self, connector_name: str, num_tokens: int) -> None:
        self.prompt_tokens_external += num_tokens
        self.prompt_tokens_external_by_connector[connector_name] += num_tokens

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["prompt_tokens_external_by_connector"] = dict(self.prompt_tokens_external_by_connector)
        d["kv_transfer_loopback_gbps"] = dict(self.kv_transfer_loopback_gbps)
        return d

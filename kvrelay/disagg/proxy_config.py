"""ProxyConfig: everything `kvrelay proxy` is started with, frozen."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvrelay.disagg.connections import KEEPALIVE_EXPIRY_S, SERVER_KEEP_ALIVE_S
from kvrelay.disagg.routing.instances import HashSettings
from kvrelay.disagg.routing.policies import DEFAULT_POLICY, POLICIES


@dataclass(frozen=True)
class ProxyConfig:
    # No prefill URL: no P/D, each request goes whole to one of the decode URLs (aggregated).
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    api_key: str | None = None  # sent to the backends as `Authorization: Bearer`
    prefill_timeout: float = 60.0  # seconds for the whole prefill leg before falling back
    decode_timeout: float = 600.0  # seconds the decode leg may stay silent between chunks
    connect_timeout: float = 5.0
    health_timeout: float = 2.0
    max_connections: int = 512
    # Seconds an idle connection to an instance is kept for the next leg: below the instances'
    # keep-alive timeout (SERVER_KEEP_ALIVE_S for uvicorn, vLLM and kvrelay serve), see connections.py.
    keepalive_expiry: float = KEEPALIVE_EXPIRY_S
    # "push" (NixlPushConnector clusters): both legs start at once; see push_mode.py. Needs each
    # prefill instance's KV side-channel address ("host:port"), in the order of prefill_urls.
    transfer_mode: str = "pull"
    prefill_kv_addresses: tuple[str, ...] = ()
    # Routing (kvrelay.disagg.routing.policies): per role, one of POLICIES.
    prefill_routing: str = DEFAULT_POLICY
    decode_routing: str = DEFAULT_POLICY
    # kv-aware routing tokenizes prompts with this model's tokenizer (None: the default model);
    # `tokenizer`, when given, is used instead (a kvrelay Tokenizer).
    model: str | None = None
    tokenizer: Any = None
    kv_index_stale_after: float = 5.0  # seconds a prefill's stores may take to be published
    # How the vLLM instances hash blocks, when the proxy is told (None: found from their events).
    vllm_prefix_caching_hash_algo: str | None = None
    vllm_pythonhashseed: str | None = None
    # Membership: the admin API's key (None: the admin API is off), and the health checks.
    admin_key: str | None = None
    health_interval: float = 2.0  # seconds between two checks of every instance (0: no checks)
    health_timeouts_to_drop: int = 2  # timed-out checks that take it out (as disagg/health.py counts them)

    def __post_init__(self) -> None:
        for name in ("prefill_routing", "decode_routing"):
            if getattr(self, name) not in POLICIES:
                raise ValueError(f"{name} must be one of {', '.join(POLICIES)}, got {getattr(self, name)!r}")
        if self.health_interval < 0:
            raise ValueError(f"health_interval must be >= 0 seconds, got {self.health_interval}")
        if self.keepalive_expiry < 0:
            raise ValueError(f"keepalive_expiry must be >= 0 seconds (and below the instances' keep-alive "
                             f"timeout, {SERVER_KEEP_ALIVE_S:g} s by default), got {self.keepalive_expiry}")
        if self.health_timeouts_to_drop < 1:
            raise ValueError(f"health_timeouts_to_drop must be >= 1, got {self.health_timeouts_to_drop}")
        if self.aggregated and self.transfer_mode != "pull":
            raise ValueError("push mode needs prefill instances (give at least one prefill URL)")
        self.hash_settings.vllm_schemes()  # an unknown algorithm, or xxhash missing: refused now

    @property
    def aggregated(self) -> bool:
        """No prefill pool: each request goes whole to one instance, no P/D."""
        return not self.prefill_urls

    @property
    def hash_settings(self) -> HashSettings:
        return HashSettings(self.vllm_prefix_caching_hash_algo, self.vllm_pythonhashseed)

    @property
    def kv_aware(self) -> bool:
        return "kv-aware" in (self.prefill_routing, self.decode_routing)

"""KVEventsConfig: whether an instance publishes its KV cache events, and where.

Built once at the edge from a dict or a JSON string (`--kv-events-config`, vLLM's flag), then
frozen. The keys are vLLM's, with vLLM's defaults, so the same JSON configures both engines:

    {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
     "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}

`endpoint` is bound when it holds a wildcard (`tcp://*:5557`) or is an `ipc://` or `inproc://`
address, and connected to otherwise (a collector that binds); `replay_endpoint` is always bound.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

PUBLISHERS = ("null", "zmq")

# Expected type of every key (checked by from_any and __post_init__), and whether None is allowed.
_KEY_TYPES: dict[str, tuple[type, bool]] = {
    "enable_kv_cache_events": (bool, False),
    "publisher": (str, True),
    "endpoint": (str, False),
    "replay_endpoint": (str, True),
    "buffer_steps": (int, False),
    "hwm": (int, False),
    "max_queue_size": (int, False),
    "topic": (str, False),
}


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    # "zmq" or "null"; None: "zmq" when events are enabled, else "null" (vLLM's rule).
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"  # the PUB socket
    replay_endpoint: str | None = None  # the ROUTER socket a subscriber asks for missed batches
    buffer_steps: int = 10_000  # batches (one per engine step) kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark: past it, slow subscribers lose messages
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; past it, dropped
    topic: str = ""

    def __post_init__(self) -> None:
        for key, (expected, nullable) in _KEY_TYPES.items():
            _check_type(key, getattr(self, key), expected, nullable)
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config publisher must be one of {', '.join(PUBLISHERS)}, "
                             f"got {self.publisher!r}")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"kv_events_config {key} must be >= 1, got {getattr(self, key)}")
        for key in ("endpoint", "replay_endpoint"):
            value = getattr(self, key)
            if value is not None and "://" not in value:
                raise ValueError(f"kv_events_config {key} must be a ZeroMQ address like tcp://*:5557 or "
                                 f"ipc:///tmp/events, got {value!r}")

    @property
    def publishes(self) -> bool:
        """Whether an engine with this config publishes anything."""
        return self.enable_kv_cache_events and self.publisher != "null"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def for_data_parallel_rank(self, dp_rank: int) -> KVEventsConfig:
        """Where data-parallel rank `dp_rank` publishes (vLLM's rule, so its subscribers find the
        ranks): a tcp port moves up by the rank (port 0, "any", stays), an ipc:// or inproc://
        address gets `_dp<rank>`. Rank 0 keeps the addresses as given."""
        endpoint = offset_endpoint(self.endpoint, dp_rank)
        assert endpoint is not None
        replay_endpoint = offset_endpoint(self.replay_endpoint, dp_rank)
        return replace(self, endpoint=endpoint, replay_endpoint=replay_endpoint)

    @classmethod
    def from_any(cls, value: KVEventsConfig | dict[str, Any] | str | None) -> KVEventsConfig | None:
        """Build from a config, a dict, or a JSON object string; None stays None (no events).

        Unknown keys and values of the wrong type raise ValueError naming the key.
        """
        if value is None or isinstance(value, KVEventsConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_events_config is not valid JSON ({e.msg} at column {e.colno}): "
                                 f"{value!r}") from None
        if not isinstance(value, dict):
            raise ValueError("kv_events_config must be a JSON object, a dict or a KVEventsConfig, "
                             f"got {type(value).__name__}")
        unknown = sorted(set(value) - set(_KEY_TYPES))
        if unknown:
            raise ValueError(f"unknown kv_events_config key(s) {', '.join(map(repr, unknown))}; "
                             f"known keys: {', '.join(_KEY_TYPES)}")
        return cls(**value)


def offset_endpoint(endpoint: str | None, dp_rank: int) -> str | None:
    """`endpoint` for data-parallel rank `dp_rank` (see KVEventsConfig.for_data_parallel_rank);
    ValueError when the moved tcp port would pass 65535."""
    if endpoint is None or dp_rank == 0:
        return endpoint
    if not endpoint.startswith("tcp://"):
        return f"{endpoint}_dp{dp_rank}"
    address, _, port = endpoint.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return endpoint
    moved = int(port) + dp_rank
    if moved > 65535:
        raise ValueError(f"kv_events_config endpoint {endpoint!r}: data-parallel rank {dp_rank} would "
                         f"publish on port {moved}, past 65535; give a port of at most {65535 - dp_rank}")
    return f"{address}:{moved}"


def _check_type(key: str, value: Any, expected: type, nullable: bool) -> None:
    if value is None and nullable:
        return
    # NOTE: bool is a subclass of int; a buffer of True steps is a mistake, not 1.
    wrong_bool = isinstance(value, bool) and expected is not bool
    if wrong_bool or not isinstance(value, expected):
        wanted = expected.__name__ + (" or None" if nullable else "")
        raise ValueError(f"kv_events_config key {key!r} must be {wanted}, got {value!r}")

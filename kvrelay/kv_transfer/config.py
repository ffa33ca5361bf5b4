"""KVTransferConfig: which KV connector an engine runs, in which role, and how to reach it.

Built once at the edge from a dict, a JSON string (the CLI's `--kv-transfer-config`) or an
existing config, then frozen. Field names follow vLLM's so the same JSON works for both.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, fields, replace
from typing import Any

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
LOAD_FAILURE_POLICIES = ("recompute", "fail")

# Expected type of every field, checked by from_any and __post_init__ (None allowed where listed).
_FIELD_TYPES: dict[str, tuple[type, bool]] = {
    "kv_connector": (str, True),
    "kv_role": (str, False),
    "kv_connector_module_path": (str, True),
    "kv_connector_extra_config": (dict, False),
    "kv_load_failure_policy": (str, False),
    "engine_id": (str, False),
    "kv_ip": (str, False),
    "kv_port": (int, False),
    "kv_buffer_device": (str, False),
    "kv_buffer_size": (float, True),
}
KV_BUFFER_DEVICES = ("cuda", "cpu")


def _new_engine_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class KVTransferConfig:
    # Registered connector name ("ExampleConnector", "MultiConnector", ...), or the class name
    # inside kv_connector_module_path. None: no connector.
    kv_connector: str | None = None
    kv_role: str = "kv_both"
    # Dotted module path of an external connector; kv_connector names the class inside it.
    kv_connector_module_path: str | None = None
    # Connector-specific settings, e.g. {"shared_storage_path": "/tmp/kv"} for ExampleConnector.
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    # What a failed KV load does to its request: "recompute" the missing part, or "fail" it.
    kv_load_failure_policy: str = "recompute"
    # Identifies this instance to its peers; unique per engine unless given.
    engine_id: str = field(default_factory=_new_engine_id)
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    # Where a P2P transport reads and writes KV: "cuda" where the KV lives (on a GPU: NIXL on
    # VRAM or cuda_ipc), "cpu" through a pinned host mirror (host staging: TCP, Mooncake, NIXL
    # on DRAM for GPU KV). Makes no difference on a CPU instance.
    kv_buffer_device: str = "cuda"
    # vLLM's name for a KV buffer's size in bytes. Here: the bound of the pinned host mirror that
    # host staging (kv_buffer_device "cpu") keeps of each rank's GPU KV, which caps that rank's
    # KV cache. None: half of the host memory available at start, split over the instance's TP
    # ranks (kvrelay/kv_transfer/transport/staging.py).
    kv_buffer_size: float | None = None

    def __post_init__(self) -> None:
        for name, (expected, nullable) in _FIELD_TYPES.items():
            _check_type(name, getattr(self, name), expected, nullable)
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy must be one of {', '.join(LOAD_FAILURE_POLICIES)}, "
                f"got {self.kv_load_failure_policy!r}"
            )
        if not 0 < self.kv_port < 65536:
            raise ValueError(f"kv_port must be in 1..65535, got {self.kv_port!r}")
        if self.kv_buffer_size is not None and self.kv_buffer_size <= 0:
            raise ValueError(f"kv_buffer_size must be a positive number of bytes, got "
                             f"{self.kv_buffer_size!r} (omit it for half the host's available memory)")
        if self.kv_buffer_device not in KV_BUFFER_DEVICES:
            raise ValueError(f"kv_buffer_device must be one of {', '.join(KV_BUFFER_DEVICES)}, "
                             f"got {self.kv_buffer_device!r}")
        if not self.engine_id:
            raise ValueError("engine_id must be a non-empty string (omit it to get a random one)")
        if self.kv_connector_module_path is not None and self.kv_connector is None:
            raise ValueError(
                "kv_connector_module_path is set but kv_connector is not: name the class to load "
                f"from {self.kv_connector_module_path!r} in kv_connector"
            )
        # NOTE: a private copy, so the caller's dict cannot change a frozen config afterwards.
        object.__setattr__(self, "kv_connector_extra_config", dict(self.kv_connector_extra_config))

    @property
    def is_producer(self) -> bool:
        """This instance computes KV that others use (a prefill instance, or an offloader)."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """This instance uses KV computed elsewhere (a decode instance, or a cache reader)."""
        return self.kv_role in ("kv_consumer", "kv_both")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def for_data_parallel_rank(self, dp_rank: int, tensor_parallel_size: int) -> KVTransferConfig:
        """This config as data-parallel rank `dp_rank` runs it: engine id `<id>_dp<rank>` (its
        name among peers) and KV ports from `kv_port + dp_rank * tensor_parallel_size` (its TP
        rank t at + t), so P's kv_transfer_params name the rank that holds the blocks. A
        MultiConnector child that names its own kv_port or engine_id moves the same way."""
        offset = dp_rank * tensor_parallel_size
        extra = self.kv_connector_extra_config
        children = extra.get("connectors")
        if isinstance(children, list):
            extra = {**extra, "connectors": [_child_for_rank(child, dp_rank, offset) for child in children]}
        return replace(self, engine_id=f"{self.engine_id}_dp{dp_rank}", kv_port=self.kv_port + offset,
                       kv_connector_extra_config=extra)

    @classmethod
    def from_any(cls, value: KVTransferConfig | dict[str, Any] | str | None) -> KVTransferConfig | None:
        """Build from a config, a dict, or a JSON object string; None stays None (no connector).

        Unknown keys and values of the wrong type raise ValueError naming the key.
        """
        if value is None or isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, str):
            value = _parse_json(value)
        if not isinstance(value, dict):
            raise ValueError(
                f"kv_transfer_config must be a dict, a JSON object string or a KVTransferConfig, "
                f"got {type(value).__name__}"
            )
        unknown = sorted(set(value) - set(_FIELD_TYPES))
        if unknown:
            raise ValueError(
                f"unknown kv_transfer_config key(s) {', '.join(map(repr, unknown))}; "
                f"known keys: {', '.join(_FIELD_TYPES)}"
            )
        kwargs = dict(value)
        if kwargs.get("engine_id") is None:
            kwargs.pop("engine_id", None)  # None means "generate one"
        if kwargs.get("kv_connector_extra_config") is None:
            kwargs.pop("kv_connector_extra_config", None)
        return cls(**kwargs)


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"kv_transfer_config is not valid JSON ({e.msg} at line {e.lineno}, "
                         f"column {e.colno}): {text!r}") from None


def _check_type(name: str, value: Any, expected: type, nullable: bool) -> None:
    if value is None and nullable:
        return
    # NOTE: bool is a subclass of int; a port of True is a mistake, not 1. A float takes an int.
    accepted = (int, float) if expected is float else expected
    if isinstance(value, bool) or not isinstance(value, accepted):
        wanted = expected.__name__ + (" or None" if nullable else "")
        raise ValueError(f"kv_transfer_config key {name!r} must be {wanted}, got {value!r}")


def check_kv_port_range(config: KVTransferConfig | None, tensor_parallel_size: int,
                        data_parallel_size: int) -> None:
    """Refuse, before anything starts, KV side-channel ports past 65535: rank r of TP rank t
    listens on kv_port + r * tensor_parallel_size + t, so a group needs kv_port .. kv_port +
    data_parallel_size * tensor_parallel_size - 1 (and the same from each MultiConnector child's
    own kv_port)."""
    if config is None or config.kv_connector is None:
        return
    num_ports = data_parallel_size * tensor_parallel_size
    children = config.kv_connector_extra_config.get("connectors")
    child_ports = [child["kv_port"] for child in (children if isinstance(children, list) else [])
                   if isinstance(child, dict) and isinstance(child.get("kv_port"), int)]
    for base in (config.kv_port, *child_ports):
        last = base + num_ports - 1
        if last > 65535:
            raise ValueError(
                f"the KV side-channel ports pass 65535: {data_parallel_size} data-parallel rank(s) of "
                f"{tensor_parallel_size} tensor-parallel rank(s) listen on kv_port + dp_rank * "
                f"{tensor_parallel_size} + tp_rank = {base}..{last}; give a kv_port of at most "
                f"{65536 - num_ports} in --kv-transfer-config, or fewer ranks")


def _child_for_rank(child: Any, dp_rank: int, offset: int) -> Any:
    if not isinstance(child, dict):
        return child  # MultiConnector refuses it, naming it
    moved = dict(child)
    if isinstance(child.get("kv_port"), int):
        moved["kv_port"] = child["kv_port"] + offset
    if isinstance(child.get("engine_id"), str):
        moved["engine_id"] = f"{child['engine_id']}_dp{dp_rank}"
    return moved

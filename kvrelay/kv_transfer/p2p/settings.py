"""The P2P connectors' settings: NixlConnector's extra config keys (`NixlConfig`), the push
connector's (`PushConfig`, the same plus `layerwise`), and the transport they name.

Both connectors build their transport here, from the whole settings object, so an option a
user sets for a backend reaches it whichever connector and role asks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrelay.kv_transfer.config import KVTransferConfig
    from kvrelay.kv_transfer.transport.base import KVTransport

BACKENDS = ("nixl", "tcp", "mooncake", "cuda_ipc")
DEFAULT_LOOPBACK_CHECK_BYTES = 16 << 20


def default_backend() -> str:
    """"nixl" where NIXL is installed, else the built-in "tcp"."""
    from kvrelay.kv_transfer.transport import default_transport

    return default_transport()


@dataclass(frozen=True)
class NixlConfig:
    """NixlConnector's settings, parsed once from kv_connector_extra_config (see
    kvrelay/kv_transfer/pull/connector.py for what each key means)."""

    backend: str
    lease_seconds: float = 30.0
    transfer_timeout_seconds: float = 10.0
    heartbeat_seconds: float = 2.0
    verify_checksum: bool = True
    secret_file: str | None = None
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""
    loopback_check_bytes: int = DEFAULT_LOOPBACK_CHECK_BYTES  # 0: no start-up measurement
    require_device_path: bool = False  # GPU KV on a path that is not a CUDA one refuses to start

    def mooncake_options(self) -> dict[str, Any]:
        """The transport options of backend "mooncake" (none for the other backends)."""
        if self.backend != "mooncake":
            return {}
        return {"protocol": self.mooncake_protocol, "device_name": self.mooncake_device}

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> NixlConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown NixlConnector extra config key(s) {', '.join(map(repr, unknown))}; "
                             f"known keys: {', '.join(sorted(known))}")
        values = dict(extra)
        values.setdefault("backend", default_backend())
        if values.get("loopback_check_bytes") not in (None, 0):
            from kvrelay.config import parse_size

            size = values["loopback_check_bytes"]
            values["loopback_check_bytes"] = parse_size(size, "loopback_check_bytes")
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        for name in ("lease_seconds", "transfer_timeout_seconds", "heartbeat_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if not isinstance(self.verify_checksum, bool):
            raise ValueError(f"verify_checksum must be true or false, got {self.verify_checksum!r}")
        if self.mooncake_protocol not in ("tcp", "rdma"):
            raise ValueError(f"mooncake_protocol must be 'tcp' or 'rdma', got {self.mooncake_protocol!r}")
        if not isinstance(self.mooncake_device, str):
            raise ValueError(f"mooncake_device must be a device name string, got {self.mooncake_device!r}")
        if isinstance(self.loopback_check_bytes, bool) or not isinstance(self.loopback_check_bytes, int) \
                or self.loopback_check_bytes < 0:
            raise ValueError(f"loopback_check_bytes must be a byte count like '64MiB' (0: no check), "
                             f"got {self.loopback_check_bytes!r}")
        if not isinstance(self.require_device_path, bool):
            raise ValueError(f"require_device_path must be true or false, got {self.require_device_path!r}")
        if self.secret_file is not None and not isinstance(self.secret_file, str):
            raise ValueError(f"secret_file must be a path string, got {self.secret_file!r}")


@dataclass(frozen=True)
class PushConfig(NixlConfig):
    """NixlPushConnector's settings: NixlConnector's plus how P writes."""

    layerwise: bool = True

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.layerwise, bool):
            raise ValueError(f"layerwise must be true or false, got {self.layerwise!r}")


def make_transport(settings: NixlConfig, transfer_config: KVTransferConfig,
                   secret: bytes | None) -> KVTransport:
    """The transport `settings.backend` names, with every option the settings hold for it. The
    TCP data port binds next to the side channel (kv_ip, any free port) and authenticates with
    the cluster secret.

    NOTE: the connectors call this through the module (`settings.make_transport`), so a test can
    replace it with an in-process transport."""
    return build_transport(settings, transfer_config, secret)


def build_transport(settings: NixlConfig, transfer_config: KVTransferConfig,
                    secret: bytes | None) -> KVTransport:
    """make_transport's work, never replaced by tests: the start-up path check builds its
    loopback pair with it, so it measures the backend the user configured."""
    inner = _backend_transport(settings, transfer_config, secret)
    if transfer_config.kv_buffer_device != "cpu":
        return inner
    from kvrelay.kv_transfer.transport.staging import StagedTransport

    return StagedTransport(inner)


def _backend_transport(settings: NixlConfig, transfer_config: KVTransferConfig,
                       secret: bytes | None) -> KVTransport:
    from kvrelay.kv_transfer import transport

    engine_id, host = transfer_config.engine_id, transfer_config.kv_ip
    if settings.backend == "tcp":
        return transport.create_transport("tcp", engine_id, host, secret=secret,
                                          timeout_s=settings.transfer_timeout_seconds)
    if settings.backend == "cuda_ipc":
        if transfer_config.kv_buffer_device == "cpu":
            raise ValueError("backend 'cuda_ipc' copies GPU to GPU: it does not go with kv_buffer_device "
                             "'cpu' (host staging is for backends tcp, mooncake and nixl)")
        return transport.create_transport("cuda_ipc", engine_id, host, secret=secret,
                                          timeout_s=settings.transfer_timeout_seconds)
    if settings.backend == "mooncake":
        return transport.create_transport("mooncake", engine_id, host, secret=secret,
                                          timeout_s=settings.transfer_timeout_seconds,
                                          **settings.mooncake_options())
    return transport.create_transport(settings.backend, engine_id)

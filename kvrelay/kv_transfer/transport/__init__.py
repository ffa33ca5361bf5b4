"""Transports: how KV bytes move between instances, behind one interface (base.py,
`KVTransport`): nixl.py (NIXL over UCX), tcp/ (kvrelay's own sockets), mooncake.py (the
Mooncake Transfer Engine) and cuda_ipc.py (GPU to GPU on one host, through CUDA IPC handles).
The P2P connectors pick one by name with `create_transport`; a transport never imports a
connector.

Importing this package imports neither NIXL, Mooncake nor torch; `create_transport("nixl", ...)`
imports NIXL only then.
"""

from __future__ import annotations

from typing import Any

from kvrelay.kv_transfer.transport.base import (
    ByteRange,
    FinishedTransfer,
    KVTransport,
    RegionLayout,
    TransferHandle,
    TransferState,
    TransportError,
)

TRANSPORTS = ("nixl", "tcp", "mooncake", "cuda_ipc")


def nixl_available() -> bool:
    """Whether the NIXL Python API can be imported here."""
    from kvrelay.kv_transfer.transport.nixl import nixl_available as available

    return available()


def nixl_installed() -> bool:
    """Whether a NIXL package is installed, without importing it (or torch)."""
    import importlib.util

    return any(importlib.util.find_spec(name) is not None for name in ("nixl_cu12", "nixl"))


def default_transport() -> str:
    """"nixl" where NIXL is installed, else the built-in "tcp"."""
    return "nixl" if nixl_installed() else "tcp"


def create_transport(name: str, engine_id: str, host: str = "127.0.0.1", *, port: int = 0,
                     secret: bytes | None = None, **options: Any) -> KVTransport:
    """A transport by name. `host`/`port`/`secret` configure the TCP data port (NIXL finds its
    own UCX addresses and ignores them; Mooncake binds `host` and signs its notifications with
    `secret`); `options` go to the backend's constructor."""
    if name == "tcp":
        from kvrelay.kv_transfer.transport.tcp import TcpTransport

        return TcpTransport(engine_id, host, port, secret=secret, **options)
    if name == "nixl":
        from kvrelay.kv_transfer.transport.nixl import NixlTransport, import_nixl

        try:
            import_nixl()
        except ImportError as e:
            raise ValueError("transport 'nixl' needs NIXL: pip install 'kvrelay[nixl]', "
                             "or use transport 'tcp'") from e
        return NixlTransport(engine_id, **options)
    if name == "mooncake":
        from kvrelay.kv_transfer.transport.mooncake import MooncakeTransport, import_mooncake_engine

        try:
            import_mooncake_engine()
        except ImportError as e:
            raise ValueError(f"transport 'mooncake' needs the Mooncake wheel ({e}): pip install "
                             "'kvrelay[mooncake]' and run scripts/install_mooncake_deps.sh") from e
        return MooncakeTransport(engine_id, host, secret=secret, **options)
    if name == "cuda_ipc":
        from kvrelay.kv_transfer.transport.cuda_ipc import CudaIpcTransport
        from kvrelay.kv_transfer.transport.ipc import check_cuda_ipc_possible

        if options.get("ipc") is None:
            check_cuda_ipc_possible()
        return CudaIpcTransport(engine_id, host, secret=secret, **options)
    raise ValueError(f"unknown transport {name!r}; choose one of {TRANSPORTS}")


__all__ = [
    "TRANSPORTS",
    "ByteRange",
    "FinishedTransfer",
    "KVTransport",
    "RegionLayout",
    "TransferHandle",
    "TransferState",
    "TransportError",
    "create_transport",
    "default_transport",
    "nixl_available",
    "nixl_installed",
]

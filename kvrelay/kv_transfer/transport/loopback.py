"""A loopback transfer: two buffers of this process on the KV device, one read into the other
through a transport, timed and checked byte for byte. What an instance runs at start to learn
which path its transport takes and how fast (p2p/path_check.py reports it).

The path is named from what the transport is and what it runs on, not guessed from speed:

    cuda_ipc     the CUDA IPC transport (measured as the device-to-device block copy it issues:
                 a process cannot open its own IPC handles, so the mapping itself is not timed)
    ucx-cuda     NIXL on VRAM with UCX's CUDA transports loadable
    ucx-host     NIXL on VRAM without them: UCX bounces every byte through host memory
    host         KV in host memory (any backend): the transport's own host path
    host-staging GPU KV through a pinned host mirror (kv_buffer_device "cpu"): chosen, so no
                 warning, but it runs at host-copy speed at best
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from kvrelay.kv_transfer.transport.base import KVTransport, TransferState
from kvrelay.kv_transfer.transport.block_copy import block_bytes_view, copy_layer, plan_copies

if TYPE_CHECKING:
    import torch

DEVICE_PATHS = ("cuda_ipc", "ucx-cuda")  # the paths that move GPU KV at device speed
_BLOCK_BYTES = 1 << 20


class DataPath(NamedTuple):
    name: str
    cause: str | None  # for a GPU, why the path is not a device one (None when it is)


class LoopbackResult(NamedTuple):
    backend: str
    device: str
    path: DataPath
    num_bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.num_bytes / max(self.seconds, 1e-9) / 1e9

    @property
    def on_device_path(self) -> bool:
        """True where KV in host memory, or GPU KV on a CUDA path."""
        return self.device == "cpu" or self.path.name in DEVICE_PATHS


def data_path(backend: str, device: str, staged: bool = False) -> DataPath:
    """The path `backend` takes for KV on `device` (see the module docstring); `staged`: through
    a pinned host mirror (kv_buffer_device "cpu")."""
    if device == "cpu":
        return DataPath("host", None)
    if staged:
        return DataPath("host-staging", None)
    if backend == "cuda_ipc":
        return DataPath("cuda_ipc", None)
    if backend == "nixl":
        from kvrelay.kv_transfer.transport.ucx_diag import ucx_facts

        facts = ucx_facts()
        return DataPath("ucx-cuda", None) if facts.cuda_transports else DataPath("ucx-host", facts.cause())
    return DataPath("host-staged", f"backend {backend!r} moves host memory only: use backend 'cuda_ipc' "
                                   "on one host, or 'nixl' with UCX's CUDA transports")


def _buffers(device: str, num_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    num_blocks = max(1, num_bytes // _BLOCK_BYTES)
    source = torch.randint(0, 256, (num_blocks, _BLOCK_BYTES), dtype=torch.uint8, device=device)
    return source, torch.zeros_like(source)  # [num_blocks, block_bytes] each


def _synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def measure_loopback(backend: str, device: str, make_transport: Callable[[str], KVTransport],
                     num_bytes: int, timeout_s: float = 30.0, staged: bool = False) -> LoopbackResult:
    """Read `num_bytes` (whole 1 MiB blocks, at least one) from one buffer on `device` into
    another through two transports `make_transport(engine_id)` made (for cuda_ipc: the block
    copy it issues), after a one-block warm-up. RuntimeError when the bytes arrive wrong or late."""
    source, target = _buffers(device, num_bytes)
    if backend == "cuda_ipc":
        seconds = _time_block_copy(source, target, device)
    else:
        seconds = _time_transport_read(source, target, make_transport, timeout_s)
    import torch

    if not torch.equal(source, target):
        raise RuntimeError(f"the {backend} loopback transfer on {device} delivered other bytes than it read")
    return LoopbackResult(backend, device, data_path(backend, device, staged), source.numel(), seconds)


def _time_block_copy(source: torch.Tensor, target: torch.Tensor, device: str) -> float:
    plan = plan_copies(range(source.shape[0]), range(source.shape[0]), None, _BLOCK_BYTES, _BLOCK_BYTES)
    copy_layer(target[:1], source[:1], plan_copies([0], [0], None, _BLOCK_BYTES, _BLOCK_BYTES))
    _synchronize(device)
    started = time.perf_counter()
    copy_layer(block_bytes_view(target), block_bytes_view(source), plan)
    _synchronize(device)
    return time.perf_counter() - started


def _time_transport_read(source: torch.Tensor, target: torch.Tensor,
                         make_transport: Callable[[str], KVTransport], timeout_s: float) -> float:
    owner, reader = make_transport("loopback-source"), make_transport("loopback-target")
    try:
        layout = owner.register_kv_caches({"loopback": source})
        reader.register_kv_caches({"loopback": target})
        reader.add_remote("loopback-source", owner.agent_metadata(), layout)
        block_ids = list(range(source.shape[0]))
        owner.stage_for_peers(block_ids)  # host staging: its mirror must hold them first
        if not owner.wait_staged(block_ids, timeout_s):
            raise RuntimeError("the loopback blocks were not staged to host memory in time")
        _read(reader, [0], timeout_s)  # warm-up: connections, registrations
        started = time.perf_counter()
        _read(reader, block_ids, timeout_s)
        return time.perf_counter() - started
    finally:
        reader.close()
        owner.close()


def _read(reader: KVTransport, block_ids: list[int], timeout_s: float) -> None:
    handle = reader.read_blocks("loopback-source", block_ids, block_ids, b"")
    deadline = time.monotonic() + timeout_s
    try:
        while (state := handle.poll()) == TransferState.PENDING:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the loopback read did not finish within {timeout_s:.0f} s")
            time.sleep(0.0002)
        if state == TransferState.ERROR:
            raise RuntimeError(f"the loopback read failed: {handle.error}")
    finally:
        handle.release()

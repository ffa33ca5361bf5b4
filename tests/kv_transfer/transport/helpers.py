"""Builders shared by the transport tests: KV pools in the engine layout and a P/D pair."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from kvrelay.kv_transfer.transport import KVTransport, TransferHandle, TransferState, create_transport

NUM_LAYERS, NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM = 3, 12, 2, 4, 8
T = TypeVar("T")


def kv_caches(seed: int, num_blocks: int = NUM_BLOCKS) -> dict[str, torch.Tensor]:
    """Random per-layer KV tensors [num_blocks, 2, H_kv, block_size, D]."""
    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 2, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    return {f"model.layers.{i}.self_attn": torch.randn(shape, generator=generator) for i in range(NUM_LAYERS)}


def require_backend(name: str) -> None:
    if name == "nixl":
        pytest.importorskip("nixl_cu12", reason="NIXL is not installed (pip install 'kvrelay[nixl]')")
    if name == "mooncake":
        from kvrelay.kv_transfer.transport.mooncake import mooncake_available

        available, reason = mooncake_available()
        if not available:
            pytest.skip(f"{reason} (pip install 'kvrelay[mooncake]'; sh scripts/install_mooncake_deps.sh)")


def wait_for(check: Callable[[], T], timeout_s: float = 10.0, what: str = "condition",
             interval_s: float = 0.002) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def finish(handle: TransferHandle, timeout_s: float = 10.0) -> TransferState:
    """Poll a read until it ends; returns DONE or ERROR."""
    wait_for(lambda: handle.poll() != TransferState.PENDING, timeout_s, "the read to end")
    state = handle.poll()
    handle.release()
    return state


def collect_notifications(owner: KVTransport, count: int, timeout_s: float = 10.0) -> list[bytes]:
    """Wait until `count` notifications arrived, then a little longer to catch duplicates."""
    received: list[bytes] = []
    wait_for(lambda: received.extend(owner.get_notifications()) or len(received) >= count, timeout_s,
             f"{count} notifications")
    time.sleep(0.05)
    received.extend(owner.get_notifications())
    return received


def new_transport(backend: str, engine_id: str, **options) -> KVTransport:
    """create_transport, with cuda_ipc on host memory (the HostIpc seam) so it runs without a GPU."""
    if backend == "cuda_ipc":
        from kvrelay.kv_transfer.transport.ipc import HostIpc

        options.setdefault("ipc", HostIpc())
    return create_transport(backend, engine_id, **options)


def make_pair(backend: str, **options) -> tuple[KVTransport, KVTransport, dict, dict]:
    """P and D transports with distinct random KV, D connected to P by hand (as the handshake would)."""
    p = new_transport(backend, "engine-p", **options)
    d = new_transport(backend, "engine-d", **options)
    p_kv, d_kv = kv_caches(seed=1), kv_caches(seed=2)
    layout = p.register_kv_caches(p_kv)
    d.register_kv_caches(d_kv)
    d.add_remote("engine-p", p.agent_metadata(), layout)
    return p, d, p_kv, d_kv

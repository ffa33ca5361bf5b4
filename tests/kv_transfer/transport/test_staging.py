"""Host staging (kv_buffer_device "cpu"): KV read by a host transport through a pinned host
mirror. Here the "device" KV is host memory too, so the mirror's bookkeeping (what is staged when,
what a pin waits for, which bytes go back) runs for real with each host transport inside."""

from __future__ import annotations

import threading

import pytest
import torch

from kvrelay.kv_transfer.transport import TransferState, create_transport
from kvrelay.kv_transfer.transport.base import ByteRange
from kvrelay.kv_transfer.transport.staging import StagedTransport
from tests.kv_transfer.transport.helpers import (
    BLOCK_SIZE,
    HEAD_DIM,
    NUM_BLOCKS,
    NUM_KV_HEADS,
    collect_notifications,
    finish,
    kv_caches,
    require_backend,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["tcp", "mooncake", "nixl"])
def staged_pair(request):
    """P and D staged over each host transport (skipped where it does not load)."""
    require_backend(request.param)
    threads_before = set(threading.enumerate())
    p = StagedTransport(create_transport(request.param, "engine-p"))
    d = StagedTransport(create_transport(request.param, "engine-d"))
    p_kv, d_kv = kv_caches(seed=1), kv_caches(seed=2)
    layout = p.register_kv_caches(p_kv)
    d.register_kv_caches(d_kv)
    d.add_remote("engine-p", p.agent_metadata(), layout)
    yield p, d, p_kv, d_kv
    d.close()
    p.close()
    assert [t for t in threading.enumerate() if t not in threads_before] == []


def test_staged_blocks_reach_d_kv_through_both_mirrors(staged_pair) -> None:
    p, d, p_kv, d_kv = staged_pair
    d_before = {name: kv.clone() for name, kv in d_kv.items()}
    p.stage_for_peers([7, 2, 3])
    assert p.wait_staged([7, 2, 3], 5)
    assert finish(d.read_blocks("engine-p", [0, 5, 6], [7, 2, 3], b"r:1")) == TransferState.DONE
    others = [b for b in range(NUM_BLOCKS) if b not in (0, 5, 6)]
    for name in p_kv:
        assert torch.equal(d_kv[name][[0, 5, 6]], p_kv[name][[7, 2, 3]])
        assert torch.equal(d_kv[name][others], d_before[name][others])
    assert collect_notifications(p, 1) == [b"r:1"]


def test_a_pin_waits_for_staging_and_unstaged_blocks_are_never_ready(staged_pair) -> None:
    p, _, _, _ = staged_pair
    assert not p.wait_staged([4], 0.01)  # never staged: its mirror holds no KV of it
    p.stage_for_peers([4])
    assert p.wait_staged([4], 5) and p.blocks_staged == 1


def test_a_read_is_done_only_once_the_copy_back_ran() -> None:
    p = StagedTransport(create_transport("tcp", "engine-p"))
    d = StagedTransport(create_transport("tcp", "engine-d"), copy_delay_s=0.3)
    try:
        p_kv, d_kv = kv_caches(seed=1), kv_caches(seed=2)
        d.register_kv_caches(d_kv)
        d.add_remote("engine-p", p.agent_metadata(), p.register_kv_caches(p_kv))
        p.stage_for_peers([1])
        handle = d.read_blocks("engine-p", [2], [1], b"r:1")
        assert handle.poll() == TransferState.PENDING
        wait_for(lambda: handle.poll() == TransferState.DONE, 5, "the copy back")
        assert all(torch.equal(d_kv[name][2], p_kv[name][1]) for name in d_kv)
    finally:
        d.close()
        p.close()


GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: staging copies GPU KV")])


@pytest.mark.parametrize("device", ["cpu", GPU])
def test_a_head_slice_read_copies_back_only_the_bytes_it_read(device: str) -> None:
    """On a GPU the ranges go over gathered in a pinned buffer (one DMA), then scattered."""
    p = StagedTransport(create_transport("tcp", "engine-p"))
    d = StagedTransport(create_transport("tcp", "engine-d"))
    try:
        p_kv = {name: kv.to(device) for name, kv in kv_caches(seed=1).items()}
        generator = torch.Generator().manual_seed(3)
        d_kv = {name: torch.randn(NUM_BLOCKS, 2, 2 * NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, generator=generator)
                .to(device) for name in p_kv}  # D holds twice P's heads: P's block fills half of D's
        before = {name: kv.clone() for name, kv in d_kv.items()}
        d.register_kv_caches(d_kv)
        d.add_remote("engine-p", p.agent_metadata(), p.register_kv_caches(p_kv))
        p.stage_for_peers([3])
        assert p.wait_staged([3], 10)
        head_bytes = BLOCK_SIZE * HEAD_DIM * 4
        k_bytes = NUM_KV_HEADS * head_bytes  # P's K heads -> D's first K heads, P's V -> D's first V
        ranges = [ByteRange(0, 0, k_bytes), ByteRange(k_bytes, 2 * k_bytes, k_bytes)]
        assert finish(d.read_blocks("engine-p", [4], [3], b"r:1", ranges=ranges)) == TransferState.DONE
        for name in p_kv:
            assert torch.equal(d_kv[name][4, :, :NUM_KV_HEADS], p_kv[name][3])
            assert torch.equal(d_kv[name][4, :, NUM_KV_HEADS:], before[name][4, :, NUM_KV_HEADS:])
    finally:
        d.close()
        p.close()


def test_a_failed_inner_read_fails_and_copies_nothing(staged_pair) -> None:
    _, d, _, d_kv = staged_pair
    before = {name: kv.clone() for name, kv in d_kv.items()}
    handle = d.read_blocks("engine-x", [0], [0], b"r:1")
    assert finish(handle) == TransferState.ERROR and "unknown remote" in (handle.error or "")
    assert all(torch.equal(d_kv[name], before[name]) for name in d_kv)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: staging copies GPU KV")
def test_on_a_gpu_tcp_moves_gpu_kv_through_pinned_mirrors() -> None:
    p = StagedTransport(create_transport("tcp", "engine-p"))
    d = StagedTransport(create_transport("tcp", "engine-d"))
    try:
        p_kv = {name: kv.cuda() for name, kv in kv_caches(seed=1).items()}
        d_kv = {name: kv.cuda() for name, kv in kv_caches(seed=2).items()}
        d.register_kv_caches(d_kv)
        d.add_remote("engine-p", p.agent_metadata(), p.register_kv_caches(p_kv))
        p.stage_for_peers([7, 8, 9])
        assert p.wait_staged([7, 8, 9], 10)
        assert finish(d.read_blocks("engine-p", [0, 1, 2], [7, 8, 9], b"r:1")) == TransferState.DONE
        assert all(torch.equal(d_kv[name][:3], p_kv[name][7:10]) for name in d_kv)
    finally:
        d.close()
        p.close()

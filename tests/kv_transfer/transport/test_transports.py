"""Every transport backend against one specification: P and D in one process, then in two."""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest
import torch

from kvrelay.kv_transfer.transport import TransferState
from kvrelay.kv_transfer.transport.base import ByteRange
from tests.kv_transfer.transport.helpers import (
    BLOCK_SIZE,
    HEAD_DIM,
    NUM_BLOCKS,
    NUM_KV_HEADS,
    NUM_LAYERS,
    collect_notifications,
    finish,
    kv_caches,
    make_pair,
    new_transport,
    require_backend,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)
BACKENDS = ["tcp", "nixl", "mooncake", "cuda_ipc"]  # cuda_ipc on the HostIpc seam


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    require_backend(request.param)
    return request.param


@pytest.fixture
def pair(backend):
    threads_before = set(threading.enumerate())
    p, d, p_kv, d_kv = make_pair(backend)
    yield p, d, p_kv, d_kv
    d.close()
    p.close()
    leftover = [t for t in threading.enumerate() if t not in threads_before]
    assert not leftover, f"threads left after close(): {leftover}"


def test_read_copies_remote_blocks_into_paired_local_blocks_and_nothing_else(pair):
    p, d, p_kv, d_kv = pair
    d_before = {name: kv.clone() for name, kv in d_kv.items()}
    remote_block_ids = [7, 2, 3, 4, 10]  # not contiguous, not sorted
    local_block_ids = [0, 5, 6, 9, 1]
    handle = d.read_blocks("engine-p", local_block_ids, remote_block_ids, b"req-1:1")
    assert finish(handle) == TransferState.DONE
    untouched = [b for b in range(d_kv[next(iter(d_kv))].shape[0]) if b not in local_block_ids]
    for name in p_kv:
        assert torch.equal(d_kv[name][local_block_ids], p_kv[name][remote_block_ids])
        assert torch.equal(d_kv[name][untouched], d_before[name][untouched])
    assert not torch.equal(p_kv[next(iter(p_kv))], d_kv[next(iter(d_kv))])  # P's own KV is not D's


def test_each_read_notifies_the_owner_exactly_once(pair):
    p, d, _, _ = pair
    for i in range(3):
        assert finish(d.read_blocks("engine-p", [i], [i + 4], f"req-{i}:1".encode())) == TransferState.DONE
    assert sorted(collect_notifications(p, 3)) == [b"req-0:1", b"req-1:1", b"req-2:1"]
    assert d.get_notifications() == []  # the reader is told nothing


def test_empty_read_only_delivers_the_notification(pair):
    p, d, _, d_kv = pair
    d_before = {name: kv.clone() for name, kv in d_kv.items()}
    assert finish(d.read_blocks("engine-p", [], [], b"req-hit:1")) == TransferState.DONE
    assert collect_notifications(p, 1) == [b"req-hit:1"]
    assert all(torch.equal(d_kv[name], d_before[name]) for name in d_kv)


def test_reading_from_an_unknown_or_removed_remote_ends_in_error(pair):
    p, d, _, _ = pair
    handle = d.read_blocks("engine-x", [0], [0], b"req:1")
    assert handle.poll() == TransferState.ERROR and "engine-x" in handle.error
    d.remove_remote("engine-p")
    d.remove_remote("engine-p")  # idempotent
    handle = d.read_blocks("engine-p", [0], [0], b"req:1")
    assert handle.poll() == TransferState.ERROR and "engine-p" in handle.error
    assert p.get_notifications() == []


def test_malformed_reads_are_refused_with_the_offending_ids(pair):
    _, d, _, _ = pair
    with pytest.raises(ValueError, match="one to one"):
        d.read_blocks("engine-p", [0, 1], [0], b"req:1")
    with pytest.raises(ValueError, match=r"\[99\]"):
        d.read_blocks("engine-p", [0], [99], b"req:1")


def test_a_read_by_byte_ranges_moves_one_kv_head_into_a_block_of_another_size(backend):
    """P holds 2 KV heads a block, D 1 (a TP shard of twice the size): D reads P's head 1, K and V,
    into its whole blocks; the P side is told once."""
    p = new_transport(backend, "engine-p")
    d = new_transport(backend, "engine-d")
    try:
        p_kv = kv_caches(seed=1)
        generator = torch.Generator().manual_seed(3)
        d_kv = {name: torch.randn(NUM_BLOCKS, 2, 1, BLOCK_SIZE, HEAD_DIM, generator=generator)
                for name in p_kv}
        layout = p.register_kv_caches(p_kv)
        d.register_kv_caches(d_kv)
        d.add_remote("engine-p", p.agent_metadata(), layout)
        head_bytes = BLOCK_SIZE * HEAD_DIM * 4
        ranges = [ByteRange(head_bytes, 0, head_bytes),  # K of head 1 -> K
                  ByteRange((NUM_KV_HEADS + 1) * head_bytes, head_bytes, head_bytes)]  # V of head 1 -> V
        handle = d.read_blocks("engine-p", [0, 5, 6], [7, 2, 3], b"req-slice:1", ranges=ranges)
        assert finish(handle) == TransferState.DONE
        for name in p_kv:
            assert torch.equal(d_kv[name][[0, 5, 6]], p_kv[name][[7, 2, 3], :, 1:2])
        assert collect_notifications(p, 1) == [b"req-slice:1"]
        with pytest.raises(ValueError, match="whole-block read needs blocks of one size"):
            d.read_blocks("engine-p", [0], [0], b"req:1")
        with pytest.raises(ValueError, match="runs past a block"):
            d.read_blocks("engine-p", [0], [0], b"req:1", ranges=[ByteRange(0, head_bytes, 2 * head_bytes)])
        with pytest.raises(ValueError, match="overlap"):
            d.read_blocks("engine-p", [0], [0], b"req:1",
                          ranges=[ByteRange(0, 0, head_bytes), ByteRange(0, head_bytes // 2, head_bytes)])
        assert len(d_kv) == NUM_LAYERS
    finally:
        d.close()
        p.close()


def test_a_remote_with_another_layout_is_refused(backend):
    p = new_transport(backend, "engine-p")
    d = new_transport(backend, "engine-d")
    try:
        layout = p.register_kv_caches({"layer.0": torch.zeros(4, 2, 1, 4, 8)})
        d.register_kv_caches(kv_caches(seed=2))
        with pytest.raises(ValueError, match="layout"):
            d.add_remote("engine-p", p.agent_metadata(), layout)
    finally:
        d.close()
        p.close()


def test_close_is_idempotent_and_stops_every_thread(backend):
    threads_before = set(threading.enumerate())
    p, d, _, _ = make_pair(backend)
    assert finish(d.read_blocks("engine-p", [1, 2], [3, 4], b"req:1")) == TransferState.DONE
    for transport in (d, p, d, p):
        transport.close()
    assert [t for t in threading.enumerate() if t not in threads_before] == []


# --- P and D in two processes ---------------------------------------------------------------

def serve_blocks(backend: str, conn) -> None:
    """P's process: register seed-1 KV, hand out the handshake data, report notifications."""
    p = new_transport(backend, "engine-p")
    p_kv = kv_caches(seed=1)
    layout = p.register_kv_caches(p_kv)
    conn.send((p.agent_metadata(), layout))
    notifications = collect_notifications(p, 2, timeout_s=30)
    conn.send(notifications)
    conn.recv()  # D is done
    p.close()
    conn.send("closed")


def test_read_across_two_processes(backend):
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    proc = context.Process(target=serve_blocks, args=(backend, child), daemon=True)
    proc.start()
    d = new_transport(backend, "engine-d")
    try:
        d_kv = kv_caches(seed=2)
        d_kv_before = {name: kv.clone() for name, kv in d_kv.items()}
        d.register_kv_caches(d_kv)
        assert parent.poll(60), "P's process did not start"
        agent_metadata, layout = parent.recv()
        d.add_remote("engine-p", agent_metadata, layout)
        assert finish(d.read_blocks("engine-p", [8, 9, 3], [0, 1, 11], b"req-a:1"), 30) == TransferState.DONE
        assert finish(d.read_blocks("engine-p", [], [], b"req-b:1"), 30) == TransferState.DONE
        p_kv = kv_caches(seed=1)
        for name in d_kv:
            assert torch.equal(d_kv[name][[8, 9, 3]], p_kv[name][[0, 1, 11]])
            assert torch.equal(d_kv[name][:3], d_kv_before[name][:3])
        assert parent.poll(30)
        assert sorted(parent.recv()) == [b"req-a:1", b"req-b:1"]
        parent.send("done")
        assert parent.poll(30) and parent.recv() == "closed"
    finally:
        d.close()
        # NOTE: is_alive(), not join(): join waits for a pipe that torch's shared-memory manager
        # (started in P's process by the host IPC seam) inherits and keeps open after P exits
        try:
            wait_for(lambda: not proc.is_alive(), 30, "P's process to exit", interval_s=0.05)
        finally:
            if proc.is_alive():
                proc.kill()
    assert proc.exitcode == 0

"""Pushes (write_blocks) on every backend: P writes its blocks into D's, layer by layer, and D
gets the notification; the TCP receiver admits only what its write guard allows."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

from kvrelay.kv_transfer.transport import TransferState, create_transport
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
    new_transport,
    require_backend,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)
PUSH_BACKENDS = ["tcp", "nixl", "mooncake", "cuda_ipc"]  # cuda_ipc on the HostIpc seam


class RecordingGuard:
    """Admits writes into `allowed` blocks only; counts admitted writes still in flight."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed
        self.in_flight = 0
        self.admitted = 0
        self.landed_ranges: list[list[tuple[int, int]] | None] = []
        self._lock = threading.Lock()

    def admit(self, block_ids: Sequence[int], notification: bytes,
              ranges: Sequence[tuple[int, int]] | None = None) -> str | None:
        with self._lock:
            outside = sorted(set(block_ids) - self.allowed)
            if outside:
                return f"blocks {outside} are not registered"
            self.in_flight += 1
            self.admitted += 1
            return None

    def landed(self, block_ids: Sequence[int], layers: Sequence[int],
               ranges: Sequence[tuple[int, int]] | None = None) -> None:
        self.landed_ranges.append(None if ranges is None else list(ranges))

    def done(self, block_ids: Sequence[int], notification: bytes,
             ranges: Sequence[tuple[int, int]] | None = None) -> None:
        with self._lock:
            self.in_flight -= 1


def make_push_pair(backend: str, d_kv: dict[str, torch.Tensor] | None = None,
                   p_kv: dict[str, torch.Tensor] | None = None):
    """P knows D (as a push registration would tell it); D guards its blocks 0..5."""
    require_backend(backend)
    threads_before = set(threading.enumerate())
    p = new_transport(backend, "engine-p")
    d = new_transport(backend, "engine-d")
    p_kv = kv_caches(seed=1) if p_kv is None else p_kv
    d_kv = kv_caches(seed=2) if d_kv is None else d_kv
    p.register_kv_caches(p_kv)
    d_layout = d.register_kv_caches(d_kv)
    guard = RecordingGuard(set(range(6)))
    d.set_write_guard(guard)
    p.add_remote("engine-d", d.agent_metadata(), d_layout)
    yield p, d, p_kv, d_kv, guard
    p.close()
    d.close()
    leftover = [t for t in threading.enumerate() if t not in threads_before]
    assert not leftover, f"threads left after close(): {leftover}"


@pytest.fixture(params=PUSH_BACKENDS)
def push_pair(request):
    yield from make_push_pair(request.param)


@pytest.fixture
def tcp_push_pair():
    """Only the TCP receiver sees a write (NIXL's and Mooncake's are one-sided: the push lease
    guards those blocks, see push/receiver.py)."""
    yield from make_push_pair("tcp")


@pytest.fixture(params=PUSH_BACKENDS)
def head_push_pair(request):
    """D's blocks hold one KV head (a TP shard of twice P's size): P writes one of its two."""
    generator = torch.Generator().manual_seed(3)
    d_kv = {name: torch.randn(NUM_BLOCKS, 2, 1, BLOCK_SIZE, HEAD_DIM, generator=generator)
            for name in kv_caches(seed=0)}
    yield from make_push_pair(request.param, d_kv)


def big_kvs() -> list[dict[str, torch.Tensor]]:
    """P's and D's pools of 2 MB blocks (6 per layer, 36 MB each): a write of them is too large
    to end inside the call that posts it."""
    shape = (6, 2, NUM_KV_HEADS, 4096, HEAD_DIM * 4)
    names = list(kv_caches(seed=0))
    return [{name: torch.randn(shape, generator=torch.Generator().manual_seed(seed)) for name in names}
            for seed in (4, 5)]


@pytest.fixture(params=PUSH_BACKENDS)
def big_push_pair(request):
    p_kv, d_kv = big_kvs()
    yield from make_push_pair(request.param, d_kv=d_kv, p_kv=p_kv)


@pytest.fixture
def big_nixl_push_pair():
    """Only the NIXL transport asks an agent for each transfer's state."""
    p_kv, d_kv = big_kvs()
    yield from make_push_pair("nixl", d_kv=d_kv, p_kv=p_kv)


def test_a_write_is_announced_to_the_receiver_without_the_writer_polling_it(big_push_pair):
    """The writer's engine may be busy computing the next layers: its transport, not the engine's
    polls, must see each write through to its notification (NIXL sends it from the check that
    finds the write complete)."""
    p, d, p_kv, d_kv, _ = big_push_pair
    handle = p.write_blocks("engine-d", [0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0], b"push:big")
    assert collect_notifications(d, 1) == [b"push:big"]  # NOTE: the handle was never polled
    for name in d_kv:
        assert torch.equal(d_kv[name], p_kv[name].flip(0))
    assert finish(handle) == TransferState.DONE


def test_a_transfer_whose_check_raises_fails_alone_and_the_others_still_complete(big_nixl_push_pair):
    """One transfer whose state check raises ends as failed, with the reason, and the progress
    thread goes on seeing the others through."""
    p, d, _, _, _ = big_nixl_push_pair
    doomed: list[object] = []
    transfer, check = p.agent.transfer, p.agent.check_xfer_state

    def post(xfer):
        if not doomed:
            doomed.append(xfer)
            transfer(xfer)
            return "PROC"  # NOTE: in flight whatever the agent says, so the checks reach it
        return transfer(xfer)

    def ask(xfer):
        if xfer is doomed[0]:
            raise RuntimeError("agent gone")
        return check(xfer)

    p.agent.transfer, p.agent.check_xfer_state = post, ask
    broken = p.write_blocks("engine-d", [0, 1, 2], [0, 1, 2], b"push:broken")
    healthy = p.write_blocks("engine-d", [3, 4, 5], [3, 4, 5], b"push:healthy")
    received: list[bytes] = []
    wait_for(lambda: received.extend(d.get_notifications()) or b"push:healthy" in received,
             what="the healthy write's notification")
    assert finish(healthy) == TransferState.DONE
    assert broken.poll() == TransferState.ERROR
    assert "agent gone" in (broken.error or "")
    broken.release()


def test_a_write_by_byte_ranges_lands_one_kv_head_in_a_block_of_another_size(head_push_pair):
    p, d, p_kv, d_kv, guard = head_push_pair
    head_bytes = BLOCK_SIZE * HEAD_DIM * 4
    before = {name: kv.clone() for name, kv in d_kv.items()}
    # P's head 1, K and V, into D's whole blocks (local = P's offset, remote = D's)
    ranges = [ByteRange(0, head_bytes, head_bytes), ByteRange(head_bytes, (NUM_KV_HEADS + 1) * head_bytes,
                                                              head_bytes)]
    handle = p.write_blocks("engine-d", [7, 2, 3], [0, 5, 4], b"push:slice", layers=[0, 2], ranges=ranges)
    assert finish(handle) == TransferState.DONE
    names = list(d_kv)
    for i in (0, 2):
        assert torch.equal(d_kv[names[i]][[0, 5, 4]], p_kv[names[i]][[7, 2, 3], :, 1:2])
    assert torch.equal(d_kv[names[1]], before[names[1]])  # a layer not written is untouched
    assert collect_notifications(d, 1) == [b"push:slice"]
    if d.sees_writes:  # the guard heard which bytes of each block landed
        assert guard.landed_ranges == [[(0, head_bytes), (head_bytes, head_bytes)]]
    with pytest.raises(ValueError, match="whole-block read needs blocks of one size"):
        p.write_blocks("engine-d", [0], [0], b"")
    with pytest.raises(ValueError, match="runs past a block"):
        p.write_blocks("engine-d", [0], [0], b"", ranges=[ByteRange(head_bytes, 0, 2 * head_bytes)])
    with pytest.raises(ValueError, match="overlap"):  # where the write lands
        overlapping = [ByteRange(0, 0, head_bytes), ByteRange(head_bytes // 2, head_bytes, head_bytes)]
        p.write_blocks("engine-d", [0], [0], b"", ranges=overlapping)


def test_layer_writes_land_in_the_paired_blocks_of_those_layers_only(push_pair):
    p, d, p_kv, d_kv, _ = push_pair
    names = list(d_kv)
    before = {name: kv.clone() for name, kv in d_kv.items()}
    local, remote = [7, 8, 2], [4, 5, 0]  # P's blocks -> D's blocks, pairwise
    assert finish(p.write_blocks("engine-d", local, remote, b"", layers=[1])) == TransferState.DONE
    assert torch.equal(d_kv[names[1]][remote], p_kv[names[1]][local])
    for i in (0, 2):  # other layers untouched
        assert torch.equal(d_kv[names[i]], before[names[i]])
    others = [b for b in range(d_kv[names[1]].shape[0]) if b not in remote]
    assert torch.equal(d_kv[names[1]][others], before[names[1]][others])
    assert d.get_notifications() == []  # an empty notification is not delivered


def test_the_completing_write_carries_the_notification_to_the_receiver(push_pair):
    p, d, p_kv, d_kv, _ = push_pair
    for layer in range(NUM_LAYERS - 1):
        assert finish(p.write_blocks("engine-d", [3], [1], b"", layers=[layer])) == TransferState.DONE
    last = p.write_blocks("engine-d", [3], [1], b"push:req-1", layers=[NUM_LAYERS - 1])
    assert finish(last) == TransferState.DONE
    assert collect_notifications(d, 1) == [b"push:req-1"]
    for name in p_kv:
        assert torch.equal(d_kv[name][1], p_kv[name][3])


def test_tcp_receiver_refuses_writes_outside_its_registered_blocks(tcp_push_pair):
    p, d, p_kv, d_kv, guard = tcp_push_pair
    before = {name: kv.clone() for name, kv in d_kv.items()}
    handle = p.write_blocks("engine-d", [1, 2], [5, 9], b"push:stray")  # 9 is not registered
    assert finish(handle) == TransferState.ERROR
    assert "not registered" in (handle.error or "")
    for name in d_kv:
        assert torch.equal(d_kv[name], before[name])
    assert d.get_notifications() == []
    # the connection survives the refusal: the next admitted write lands
    assert finish(p.write_blocks("engine-d", [1], [5], b"")) == TransferState.DONE
    assert guard.admitted == 1 and guard.in_flight == 0


def test_tcp_receiver_without_a_guard_accepts_no_push():
    p = create_transport("tcp", "engine-p")
    d = create_transport("tcp", "engine-d")
    try:
        p.register_kv_caches(kv_caches(seed=1))
        p.add_remote("engine-d", d.agent_metadata(), d.register_kv_caches(kv_caches(seed=2)))
        handle = p.write_blocks("engine-d", [0], [0], b"")
        assert finish(handle) == TransferState.ERROR
        assert "accepts no pushed KV" in (handle.error or "")
    finally:
        p.close()
        d.close()


def test_malformed_writes_are_refused_before_anything_moves(push_pair):
    p, _, _, _, _ = push_pair
    with pytest.raises(ValueError, match="outside the pool"):
        p.write_blocks("engine-d", [0], [99], b"")
    with pytest.raises(ValueError, match="layers"):
        p.write_blocks("engine-d", [0], [0], b"", layers=[NUM_LAYERS])
    assert p.write_blocks("unknown", [0], [0], b"").poll() == TransferState.ERROR

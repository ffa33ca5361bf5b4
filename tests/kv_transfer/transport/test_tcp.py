"""The TCP backend's own promises: a dead or stalled peer ends a read in ERROR within the
timeout, the shared secret gates the data port, adjacent blocks travel as one slice, a read moves
in a few vectored calls that survive partial progress, and P refuses malformed requests."""

from __future__ import annotations

import multiprocessing as mp
import socket
import struct
import threading
import time

import pytest
import torch

from kvrelay.kv_transfer.transport import TransferState, create_transport
from kvrelay.kv_transfer.transport.tcp import wire
from kvrelay.kv_transfer.transport.tcp.wire import HELLO, READ, STATUS, paired_runs, runs
from tests.kv_transfer.transport.helpers import (
    NUM_BLOCKS,
    collect_notifications,
    finish,
    kv_caches,
    make_pair,
    wait_for,
)

pytestmark = pytest.mark.timeout(60)


class FakeOwner:
    """A P that answers one READ with half the bytes, then hangs up or goes silent."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        sock, _ = self.listener.accept()
        with sock:
            sock.sendall(HELLO.pack(b"KVR1", False, bytes(16)))
            _, num_ids, notification_len = READ.unpack(sock.recv(READ.size, socket.MSG_WAITALL))
            sock.recv(4 * num_ids + notification_len, socket.MSG_WAITALL)
            if self.behaviour == "huge error":
                sock.sendall(STATUS.pack(1, 1 << 30))  # announces a 1 GiB reason
            else:
                sock.sendall(STATUS.pack(0, 0) + bytes(100))  # far less than a block
            if self.behaviour == "stall":
                self.done.wait(30)
        self.listener.close()


def connect_to_fake(behaviour: str, timeout_s: float):
    owner = FakeOwner(behaviour)
    d = create_transport("tcp", "engine-d", timeout_s=timeout_s)
    layout = d.register_kv_caches(kv_caches(seed=2))
    d.add_remote("engine-p", f"{owner.address[0]}:{owner.address[1]}".encode(), layout)
    return owner, d


@pytest.mark.parametrize("behaviour", ["hang up", "stall"])
def test_a_peer_that_dies_or_stalls_mid_read_ends_the_read_in_error(behaviour):
    owner, d = connect_to_fake(behaviour, timeout_s=1.0)
    try:
        start = time.monotonic()
        handle = d.read_blocks("engine-p", [0, 1], [2, 3], b"req:1")
        assert finish(handle, timeout_s=10) == TransferState.ERROR
        assert time.monotonic() - start < 5
        assert "engine-p" in handle.error
    finally:
        owner.done.set()
        d.close()
        owner.thread.join(5)


def test_wrong_or_missing_secret_is_refused_and_the_right_one_reads():
    p = create_transport("tcp", "engine-p", secret=b"cluster-secret")
    p_kv = kv_caches(seed=1)
    layout = p.register_kv_caches(p_kv)
    readers = {secret: create_transport("tcp", f"engine-d-{i}", secret=secret)
               for i, secret in enumerate([b"wrong-secret", None, b"cluster-secret"])}
    try:
        for secret, d in readers.items():
            d.register_kv_caches(kv_caches(seed=2))
            d.add_remote("engine-p", p.agent_metadata(), layout)
            handle = d.read_blocks("engine-p", [0], [1], b"req:1")
            state = finish(handle)
            if secret == b"cluster-secret":
                assert state == TransferState.DONE
            else:
                assert state == TransferState.ERROR and "secret" in handle.error
        time.sleep(0.05)
        assert p.get_notifications() == [b"req:1"]
    finally:
        for d in readers.values():
            d.close()
        p.close()


def test_a_reader_with_a_secret_refuses_an_owner_without_one():
    p, d, _, _ = make_pair("tcp")
    d.secret = b"cluster-secret"
    try:
        handle = d.read_blocks("engine-p", [0], [1], b"req:1")
        assert finish(handle) == TransferState.ERROR and "secret" in handle.error
    finally:
        d.close()
        p.close()


def test_reads_reuse_one_connection_and_reconnect_when_it_broke():
    p, d, _, _ = make_pair("tcp")
    try:
        for _ in range(3):
            assert finish(d.read_blocks("engine-p", [0], [1], b"req:1")) == TransferState.DONE
        remote = d._remotes["engine-p"]
        assert len(remote.idle) == 1
        remote.idle[0].shutdown(socket.SHUT_RDWR)  # the connection breaks between reads
        assert finish(d.read_blocks("engine-p", [0], [1], b"req:1")) == TransferState.DONE
        assert len(remote.idle) == 1
    finally:
        d.close()
        p.close()


def _record_request_senders(monkeypatch) -> list[str]:
    """Names of the threads that send READ requests, in order."""
    senders: list[str] = []
    real = socket.socket.sendall

    def sendall(sock, data, *args):
        if bytes(data[:4]) == b"READ":
            senders.append(threading.current_thread().name)
        return real(sock, data, *args)
    monkeypatch.setattr(socket.socket, "sendall", sendall)
    return senders


def test_a_read_on_an_idle_connection_is_asked_from_the_callers_thread_unless_the_pool_is_busy(
        monkeypatch):
    senders = _record_request_senders(monkeypatch)
    p, d, p_kv, d_kv = make_pair("tcp", num_workers=1)
    try:
        assert finish(d.read_blocks("engine-p", [0], [1], b"a:1")) == TransferState.DONE  # connects
        assert finish(d.read_blocks("engine-p", [2], [3], b"b:1")) == TransferState.DONE  # idle one
        d._in_flight = 1  # as if the only pool thread were busy with another read
        assert finish(d.read_blocks("engine-p", [4], [5], b"c:1")) == TransferState.DONE
        assert d._in_flight == 1
        main = threading.current_thread().name
        assert senders[1] == main
        assert senders[0] != main and senders[2] != main  # the pool's thread
        for local, remote in ((0, 1), (2, 3), (4, 5)):
            assert torch.equal(d_kv[next(iter(d_kv))][local], p_kv[next(iter(p_kv))][remote])
        assert sorted(collect_notifications(p, 3)) == [b"a:1", b"b:1", b"c:1"]
    finally:
        d._in_flight = 0
        d.close()
        p.close()


def test_a_request_sent_early_on_a_connection_p_has_closed_is_asked_again_on_a_fresh_one():
    p, d, p_kv, d_kv = make_pair("tcp")
    try:
        assert finish(d.read_blocks("engine-p", [0], [1], b"a:1")) == TransferState.DONE
        server = p._server
        with server._lock:
            served = list(server._connections)
        for sock in served:  # P drops its end (a restart, a timeout); D's idle end does not know
            sock.shutdown(socket.SHUT_RDWR)
        wait_for(lambda: not server._connections, 5.0, "P to drop the connection")
        assert finish(d.read_blocks("engine-p", [2], [3], b"b:1")) == TransferState.DONE
        assert torch.equal(d_kv[next(iter(d_kv))][2], p_kv[next(iter(p_kv))][3])
        assert len(d._remotes["engine-p"].idle) == 1
    finally:
        d.close()
        p.close()


def test_adjacent_blocks_become_one_slice():
    assert runs([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]
    # local 0,1,2 pair with remote 3,4,5 (one slice); local 7 with remote 6 breaks the local run
    assert paired_runs([0, 1, 2, 7, 8], [3, 4, 5, 6, 7]) == [(0, 3), (7, 2)]
    assert paired_runs([0, 1], [5, 4]) == [(0, 1), (1, 1)]


def serve_then_wait(conn) -> None:
    p = create_transport("tcp", "engine-p")
    p_kv = kv_caches(seed=1)
    conn.send((p.agent_metadata(), p.register_kv_caches(p_kv)))
    time.sleep(60)  # killed by the test


def test_reading_from_a_killed_owner_process_ends_in_error():
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    proc = context.Process(target=serve_then_wait, args=(child,), daemon=True)
    proc.start()
    d = create_transport("tcp", "engine-d", timeout_s=2.0)
    try:
        d.register_kv_caches(kv_caches(seed=2))
        assert parent.poll(60)
        agent_metadata, layout = parent.recv()
        d.add_remote("engine-p", agent_metadata, layout)
        assert finish(d.read_blocks("engine-p", [0], [1], b"req:1"), 30) == TransferState.DONE
        proc.kill()
        proc.join(10)
        handle = d.read_blocks("engine-p", [0], [1], b"req:2")
        assert finish(handle, 10) == TransferState.ERROR and "engine-p" in handle.error
    finally:
        d.close()
        if proc.is_alive():
            proc.kill()


def test_a_peer_announcing_a_huge_error_message_fails_the_read_without_reading_it():
    owner, d = connect_to_fake("huge error", timeout_s=1.0)
    try:
        handle = d.read_blocks("engine-p", [0], [1], b"req:1")
        assert finish(handle) == TransferState.ERROR
        assert "1073741824-byte error message" in handle.error
    finally:
        owner.done.set()
        d.close()
        owner.thread.join(5)


# --- vectored sends and receives -------------------------------------------------------------

class TrickleSocket:
    """Moves at most `step` bytes a call, like a socket that a timeout or a signal keeps
    cutting short; records how many buffers each call was handed."""

    def __init__(self, step: int, payload: bytes = b"") -> None:
        self.step, self.payload, self.sent = step, payload, bytearray()
        self.buffers_per_call: list[int] = []

    def sendmsg(self, buffers) -> int:
        self.buffers_per_call.append(len(buffers))
        out = b"".join(bytes(b) for b in buffers)[:self.step]
        self.sent += out
        return len(out)

    def recvmsg_into(self, buffers, ancbufsize, flags):
        assert flags & socket.MSG_WAITALL
        self.buffers_per_call.append(len(buffers))
        chunk, offset = self.payload[:self.step], 0
        for buffer in buffers:
            n = min(len(buffer), len(chunk) - offset)
            buffer[:n] = chunk[offset:offset + n]
            offset += n
        self.payload = self.payload[offset:]
        return offset, [], 0, None


def split_views(buffer: bytearray, sizes: list[int]) -> list[memoryview]:
    view, views, offset = memoryview(buffer), [], 0
    for size in sizes:
        views.append(view[offset:offset + size])
        offset += size
    return views


SIZES = [5, 0, 13, 1, 8, 0, 21, 3]  # empty slices included: they must not stall the loop


@pytest.mark.parametrize("step", [1, 4, 7, 1000])
def test_vectored_send_survives_partial_sends_and_keeps_the_byte_order(monkeypatch, step):
    monkeypatch.setattr(wire, "IOV_MAX", 3)
    payload = bytearray(range(sum(SIZES)))
    sock = TrickleSocket(step)
    wire.send_views(sock, split_views(payload, SIZES))  # type: ignore[arg-type]
    assert bytes(sock.sent) == bytes(payload)
    assert max(sock.buffers_per_call) <= 3


@pytest.mark.parametrize("step", [1, 4, 7, 1000])
def test_vectored_receive_survives_partial_reads_and_fills_every_view(monkeypatch, step):
    monkeypatch.setattr(wire, "IOV_MAX", 3)
    payload = bytes(range(sum(SIZES)))
    target = bytearray(len(payload))
    sock = TrickleSocket(step, payload)
    wire.recv_views(sock, split_views(target, SIZES))  # type: ignore[arg-type]
    assert bytes(target) == payload
    assert max(sock.buffers_per_call) <= 3


def test_vectored_receive_from_a_peer_that_closes_early_says_how_far_it_got():
    sock = TrickleSocket(4, bytes(10))  # 10 of the 50 bytes, then end of stream
    with pytest.raises(ConnectionError, match="after 10 of 50 bytes"):
        wire.recv_views(sock, split_views(bytearray(50), [20, 30]))  # type: ignore[arg-type]


def test_a_scattered_read_over_more_slices_than_one_call_takes_lands_in_the_right_blocks(monkeypatch):
    monkeypatch.setattr(wire, "IOV_MAX", 4)  # 3 layers x 5 runs = 15 slices: several calls each way
    p, d, p_kv, d_kv = make_pair("tcp")
    try:
        remote_block_ids = [9, 0, 1, 5, 3, 4, 11]
        local_block_ids = [2, 3, 4, 0, 7, 8, 10]  # 3 4 pairs with 0 1, 7 8 with 3 4
        assert len(paired_runs(local_block_ids, remote_block_ids)) == 5
        handle = d.read_blocks("engine-p", local_block_ids, remote_block_ids, b"req:1")
        assert finish(handle) == TransferState.DONE
        for name in p_kv:
            assert torch.equal(d_kv[name][local_block_ids], p_kv[name][remote_block_ids])
        assert collect_notifications(p, 1) == [b"req:1"]
    finally:
        d.close()
        p.close()


def test_a_whole_read_takes_one_vectored_call_each_way(monkeypatch):
    calls = {"send_views": 0, "recv_views": 0}  # calls that move block bytes, not headers

    def counting(name):
        real = getattr(wire, name)

        def counted(sock, views):
            calls[name] += sum(len(v) for v in views) > 64
            return real(sock, views)
        return counted
    for name in calls:
        monkeypatch.setattr(wire, name, counting(name))
    p, d, _, _ = make_pair("tcp")
    try:
        handle = d.read_blocks("engine-p", list(range(6)), [5, 6, 7, 0, 1, 2], b"req:1")
        assert finish(handle) == TransferState.DONE
        assert calls == {"send_views": 1, "recv_views": 1}
    finally:
        d.close()
        p.close()


# --- P's data port against a reader that misbehaves --------------------------------------------

def raw_reader(p) -> socket.socket:
    """A connection to P's data port that has read the hello (P has no secret)."""
    sock = socket.create_connection(p.address, timeout=5)
    hello = sock.recv(HELLO.size, socket.MSG_WAITALL)
    assert HELLO.unpack(hello)[:2] == (b"KVR1", False)
    return sock


def send_read(sock: socket.socket, block_ids: list[int], notification: bytes,
              num_ids: int | None = None) -> None:
    count = len(block_ids) if num_ids is None else num_ids
    sock.sendall(READ.pack(b"READ", count, len(notification))
                 + struct.pack(f"!{len(block_ids)}I", *block_ids) + notification)


def hung_up(sock: socket.socket) -> bool:
    """Whether P closed the connection (a reset, when P left part of the request unread)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def read_refusal(sock: socket.socket) -> str:
    status, message_len = STATUS.unpack(sock.recv(STATUS.size, socket.MSG_WAITALL))
    assert status == 1
    return sock.recv(message_len, socket.MSG_WAITALL).decode()


@pytest.fixture
def owner():
    threads_before = set(threading.enumerate())
    p = create_transport("tcp", "engine-p")
    p_kv = kv_caches(seed=1)
    p.register_kv_caches(p_kv)
    yield p, p_kv
    p.close()
    leftover = [t for t in threading.enumerate() if t not in threads_before]
    assert not leftover, f"threads left after close(): {leftover}"


def test_out_of_range_ids_are_refused_and_the_connection_still_serves(owner):
    p, p_kv = owner
    block_bytes = p_kv[next(iter(p_kv))][0].numel() * 4
    with raw_reader(p) as sock:
        send_read(sock, [0, NUM_BLOCKS + 7], b"bad:1")
        expected = f"block ids [{NUM_BLOCKS + 7}] are outside the pool of {NUM_BLOCKS} blocks"
        assert read_refusal(sock) == expected
        send_read(sock, [3], b"good:1")
        assert STATUS.unpack(sock.recv(STATUS.size, socket.MSG_WAITALL)) == (0, 0)
        received = bytearray(len(p_kv) * block_bytes)
        wire.recv_views(sock, [memoryview(received)])
        expected = b"".join(kv[3].numpy().tobytes() for kv in p_kv.values())
        assert bytes(received) == expected
        sock.sendall(b"A")
        assert collect_notifications(p, 1) == [b"good:1"]


@pytest.mark.parametrize("num_ids, notification, expected", [
    (NUM_BLOCKS + 1, b"r:1", f"a read of {NUM_BLOCKS + 1} blocks is more than the whole pool of "
                             f"{NUM_BLOCKS}"),
    (2**32 - 1, b"r:1", "a read of 4294967295 blocks"),
    (1, b"x" * (wire.MAX_NOTIFICATION_BYTES + 1), "over the limit of 65536"),
])
def test_an_oversize_request_is_refused_before_its_body_is_read_and_the_connection_closed(
        owner, num_ids, notification, expected):
    p, _ = owner
    with raw_reader(p) as sock:
        send_read(sock, [0], notification, num_ids=num_ids)
        assert expected in read_refusal(sock)
        assert hung_up(sock)  # the rest of the stream cannot be parsed
    assert p.get_notifications() == []


def send_range_read(sock: socket.socket, block_ids: list[int], ranges: list[tuple[int, int]],
                    notification: bytes, num_ranges: int | None = None) -> None:
    flat = [value for r in ranges for value in r]
    sock.sendall(READ.pack(b"RRNG", len(block_ids), len(notification))
                 + struct.pack("!I", len(ranges) if num_ranges is None else num_ranges)
                 + struct.pack(f"!{len(block_ids)}I", *block_ids) + struct.pack(f"!{len(flat)}I", *flat)
                 + notification)


def test_a_range_read_past_a_block_is_refused_and_an_honest_one_streams_only_its_ranges(owner):
    p, p_kv = owner
    block_bytes = p_kv[next(iter(p_kv))][0].numel() * 4
    with raw_reader(p) as sock:
        send_range_read(sock, [2], [(block_bytes - 8, 16)], b"bad:1")
        assert "run past a block of" in read_refusal(sock)
        send_range_read(sock, [2, 5], [(8, 16), (40, 8)], b"good:1")
        assert STATUS.unpack(sock.recv(STATUS.size, socket.MSG_WAITALL)) == (0, 0)
        received = bytearray(len(p_kv) * 2 * 24)
        wire.recv_views(sock, [memoryview(received)])
        expected = b"".join(kv[b].numpy().tobytes()[offset:offset + length] for kv in p_kv.values()
                            for b in (2, 5) for offset, length in ((8, 16), (40, 8)))
        assert bytes(received) == expected
        sock.sendall(b"A")
        assert collect_notifications(p, 1) == [b"good:1"]


def test_a_range_read_naming_too_many_ranges_is_refused_unread(owner):
    p, _ = owner
    with raw_reader(p) as sock:
        send_range_read(sock, [0], [(0, 8)], b"r:1", num_ranges=wire.MAX_RANGES + 1)
        assert "byte ranges per block is over the limit" in read_refusal(sock)
        assert hung_up(sock)


def test_a_request_with_a_bad_magic_closes_the_connection(owner):
    p, _ = owner
    with raw_reader(p) as sock:
        sock.sendall(READ.pack(b"EVIL", 1, 3) + struct.pack("!I", 0) + b"r:1")
        assert hung_up(sock)


def test_reads_before_the_kv_caches_are_registered_are_refused():
    p = create_transport("tcp", "engine-p")
    try:
        with raw_reader(p) as sock:
            send_read(sock, [], b"r:1")
            assert read_refusal(sock) == "this engine has registered no KV caches yet"
        assert p.get_notifications() == []
    finally:
        p.close()


@pytest.mark.parametrize("hang_up_after", ["status", "some blocks", "all blocks"])
def test_a_reader_that_hangs_up_mid_transfer_gets_no_notification_and_p_serves_on(hang_up_after):
    p = create_transport("tcp", "engine-p")
    p_kv = kv_caches(seed=1, num_blocks=256)  # 1.5 MB: more than the socket buffers hold
    p.register_kv_caches(p_kv)
    try:
        with raw_reader(p) as sock:
            send_read(sock, list(range(256)), b"quitter:1")
            sock.recv(STATUS.size, socket.MSG_WAITALL)
            if hang_up_after == "some blocks":
                sock.recv(4096, socket.MSG_WAITALL)
            elif hang_up_after == "all blocks":
                total = sum(kv.numel() * kv.element_size() for kv in p_kv.values())
                wire.recv_views(sock, [memoryview(bytearray(total))])
        # NOTE: P's serving thread ends once its send (or its wait for the ACK) fails
        wait_for(lambda: not p._server._connections, what="P to drop the connection")
        d = create_transport("tcp", "engine-d")
        try:
            d_kv = kv_caches(seed=2, num_blocks=256)
            d.register_kv_caches(d_kv)
            d.add_remote("engine-p", p.agent_metadata(), p.layout)
            assert finish(d.read_blocks("engine-p", [0, 1], [8, 9], b"stayer:1")) == TransferState.DONE
            assert collect_notifications(p, 1) == [b"stayer:1"]
        finally:
            d.close()
    finally:
        p.close()



def test_a_finished_read_wakes_the_engine_once_the_handle_polls_done(monkeypatch):
    from kvrelay.kv_transfer import wakeup

    futures: list = []
    done_at_notify: list[bool] = []
    monkeypatch.setattr(wakeup, "notify", lambda: done_at_notify.append(futures[-1].done()))
    p, d, _, _ = make_pair("tcp")
    submit = d._pool.submit

    def recording_submit(*args, **kwargs):
        futures.append(submit(*args, **kwargs))
        return futures[-1]
    monkeypatch.setattr(d._pool, "submit", recording_submit)
    try:
        assert finish(d.read_blocks("engine-p", [0, 1], [2, 3], b"req:1")) == TransferState.DONE
        wait_for(lambda: done_at_notify)
        assert done_at_notify == [True]  # a poll right after the wake sees the read ended
    finally:
        d.close()
        p.close()

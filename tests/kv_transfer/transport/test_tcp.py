"""The TCP backend's own promises: a dead or stalled peer ends a read in ERROR within the
timeout, the shared secret gates the data port, adjacent blocks travel as one slice."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time

import pytest

from kvrelay.kv_transfer.transport import TransferState, create_transport
from kvrelay.kv_transfer.transport.tcp import _HELLO, _READ, _STATUS, _paired_runs, _runs
from tests.kv_transfer.transport.helpers import finish, kv_caches, make_pair

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
            sock.sendall(_HELLO.pack(b"KVR1", False, bytes(16)))
            _, num_ids, notification_len = _READ.unpack(sock.recv(_READ.size, socket.MSG_WAITALL))
            sock.recv(4 * num_ids + notification_len, socket.MSG_WAITALL)
            sock.sendall(_STATUS.pack(0, 0) + bytes(100))  # far less than a block
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


def test_adjacent_blocks_become_one_slice():
    assert _runs([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]
    # local 0,1,2 pair with remote 3,4,5 (one slice); local 7 with remote 6 breaks the local run
    assert _paired_runs([0, 1, 2, 7, 8], [3, 4, 5, 6, 7]) == [(0, 3), (7, 2)]
    assert _paired_runs([0, 1], [5, 4]) == [(0, 1), (1, 1)]


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

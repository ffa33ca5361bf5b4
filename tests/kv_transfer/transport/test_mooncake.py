"""The Mooncake transport beyond the shared specification: folded reads, batches cut to the
engine's limit, a dead peer, signed notifications, bad options."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from kvrelay.kv_transfer.transport import TransferState, TransportError, create_transport
from tests.kv_transfer.transport.helpers import (
    collect_notifications,
    finish,
    kv_caches,
    make_pair,
    require_backend,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _mooncake() -> None:
    require_backend("mooncake")


def test_adjacent_blocks_fold_into_one_entry_per_layer_and_run():
    from kvrelay.kv_transfer.transport.mooncake import read_triples

    local, remote, lengths = read_triples([1000, 5000], [90000, 99000], 10, [0, 1, 2, 7, 8], [3, 4, 5, 6, 9])
    # runs: (0->3, 3 blocks), (7->6, 1 block: 8 follows 7 but 9 does not follow 6), (8->9, 1 block)
    assert local == [1000, 1070, 1080, 5000, 5070, 5080]
    assert remote == [90030, 90060, 90090, 99030, 99060, 99090]
    assert lengths == [30, 10, 10, 30, 10, 10]


def test_a_read_longer_than_one_engine_batch_is_cut_into_batches_and_arrives_whole():
    p, d, p_kv, d_kv = make_pair("mooncake", max_batch_entries=2)
    try:
        remote_ids, local_ids = [11, 9, 7, 5, 3, 1], [0, 2, 4, 6, 8, 10]  # nothing folds: 18 entries
        assert finish(d.read_blocks("engine-p", local_ids, remote_ids, b"req:1")) == TransferState.DONE
        for name in p_kv:
            assert torch.equal(d_kv[name][local_ids], p_kv[name][remote_ids])
        assert collect_notifications(p, 1) == [b"req:1"]
    finally:
        d.close()
        p.close()


def _serve_then_die(conn) -> None:
    p = create_transport("mooncake", "engine-p")
    layout = p.register_kv_caches(kv_caches(seed=1))
    conn.send((p.agent_metadata(), layout))
    conn.recv()
    import os

    os._exit(0)  # no close(): the process vanishes as a killed one would


def test_a_read_from_a_dead_peer_ends_in_error_and_the_transport_keeps_working():
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    proc = context.Process(target=_serve_then_die, args=(child,), daemon=True)
    proc.start()
    p, d, p_kv, d_kv = make_pair("mooncake", timeout_s=3.0)
    try:
        assert parent.poll(60), "P's process did not start"
        agent_metadata, layout = parent.recv()
        d.add_remote("engine-dead", agent_metadata, layout)
        parent.send("die")
        proc.join(30)
        handle = d.read_blocks("engine-dead", [0, 1], [2, 3], b"req-dead:1")
        assert finish(handle, 60) == TransferState.ERROR
        assert "Mooncake read" in (handle.error or "")
        assert finish(d.read_blocks("engine-p", [4], [5], b"req-ok:1")) == TransferState.DONE
        assert all(torch.equal(d_kv[name][4], p_kv[name][5]) for name in p_kv)
    finally:
        d.close()
        p.close()
        if proc.is_alive():
            proc.kill()


def test_notifications_signed_with_another_secret_are_refused():
    p = create_transport("mooncake", "engine-p", secret=b"secret-one")
    d = create_transport("mooncake", "engine-d", secret=b"secret-two", timeout_s=1.0)
    try:
        layout = p.register_kv_caches(kv_caches(seed=1))
        d.register_kv_caches(kv_caches(seed=2))
        d.add_remote("engine-p", p.agent_metadata(), layout)
        assert finish(d.read_blocks("engine-p", [], [], b"req-forged:1")) == TransferState.DONE
        d.close()  # waits for the reader, whose notification was refused
        assert p.get_notifications() == []
    finally:
        d.close()
        p.close()


def test_unknown_protocol_and_foreign_agent_metadata_are_refused_by_name():
    with pytest.raises(ValueError, match="'carrier-pigeon'"):
        create_transport("mooncake", "engine-x", protocol="carrier-pigeon")
    p, d, _, _ = make_pair("mooncake")
    try:
        with pytest.raises(TransportError, match="backend 'mooncake'"):
            d.add_remote("engine-tcp", b"host:1234", d.layout)
    finally:
        d.close()
        p.close()

"""The CUDA IPC transport's own rules, on the HostIpc seam (host memory shared between processes,
so they run without a GPU): handles opened once per peer and closed when it goes, copies folded
into runs, foreign hosts and unopenable handles refused, no GPU refused. The same transport on
CUDA runs at the end, marked gpu."""

from __future__ import annotations

import threading

import msgspec
import pytest
import torch

from kvrelay.kv_transfer.transport import TransferState, TransportError, create_transport
from kvrelay.kv_transfer.transport.base import ByteRange
from kvrelay.kv_transfer.transport.block_copy import Run, coalesce_ranges, coalesce_runs, plan_copies
from kvrelay.kv_transfer.transport.cuda_ipc import CudaIpcTransport, IpcAgent
from kvrelay.kv_transfer.transport.ipc import HostIpc
from tests.kv_transfer.transport.helpers import collect_notifications, finish, kv_caches, wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def pair():
    """P and D on their own HostIpc seams (D's counts what D opened), D connected to P."""
    threads_before = set(threading.enumerate())
    p_ipc, d_ipc = HostIpc(), HostIpc()
    p = CudaIpcTransport("engine-p", ipc=p_ipc)
    d = CudaIpcTransport("engine-d", ipc=d_ipc)
    p_kv, d_kv = kv_caches(seed=1), kv_caches(seed=2)
    layout = p.register_kv_caches(p_kv)
    d.register_kv_caches(d_kv)
    d.add_remote("engine-p", p.agent_metadata(), layout)
    yield p, d, d_ipc, p_kv, d_kv, layout
    d.close()
    p.close()
    assert d_ipc.opened == d_ipc.closed, "D left peer handles open"
    assert [t for t in threading.enumerate() if t not in threads_before] == []


# --- copy plans -------------------------------------------------------------------------------

def test_pairs_consecutive_on_both_sides_fold_into_runs() -> None:
    assert coalesce_runs([4, 5, 6, 9, 10, 0], [0, 1, 2, 3, 5, 6]) == [Run(4, 0, 3), Run(9, 3, 1),
                                                                       Run(10, 5, 1), Run(0, 6, 1)]
    assert coalesce_runs([], []) == []


def test_head_ranges_that_follow_on_both_sides_fold_and_a_whole_block_is_a_block_copy() -> None:
    k, v = ByteRange(64, 0, 32), ByteRange(96, 32, 32)  # one P head's K then V -> D's whole block
    assert coalesce_ranges([v, k], 64, 128) == [ByteRange(64, 0, 64)]
    assert coalesce_ranges([ByteRange(0, 0, 32), ByteRange(32, 32, 32)], 64, 64) is None
    assert coalesce_ranges([ByteRange(0, 0, 32), ByteRange(64, 32, 32)], 64, 128) == [
        ByteRange(0, 0, 32), ByteRange(64, 32, 32)]
    plan = plan_copies([0, 1, 2], [5, 6, 7], [k, v], 64, 128)
    assert plan.num_copies_per_layer == 1 and plan.bytes_per_layer(64) == 3 * 64


# --- handles ----------------------------------------------------------------------------------

def test_a_peer_is_opened_once_however_often_it_is_added_and_closed_when_removed(pair) -> None:
    p, d, d_ipc, p_kv, _, layout = pair
    d.add_remote("engine-p", p.agent_metadata(), layout)  # idempotent: no second open
    assert d_ipc.opened == len(p_kv) and d.open_peers == 1
    d.remove_remote("engine-p")
    assert d_ipc.closed == len(p_kv) and d.open_peers == 0
    assert finish(d.read_blocks("engine-p", [0], [0], b"r:1")) == TransferState.ERROR


def test_a_restarted_peer_is_opened_again_and_its_old_handles_are_closed(pair) -> None:
    p, d, d_ipc, p_kv, d_kv, _ = pair
    restarted = CudaIpcTransport("engine-p", ipc=HostIpc())
    try:
        new_kv = kv_caches(seed=7)
        layout = restarted.register_kv_caches(new_kv)
        d.remove_remote("engine-p")  # what the puller does on every handshake
        d.add_remote("engine-p", restarted.agent_metadata(), layout)
        assert d_ipc.opened == 2 * len(p_kv) and d_ipc.closed == len(p_kv)
        assert finish(d.read_blocks("engine-p", [3], [4], b"r:1")) == TransferState.DONE
        assert all(torch.equal(d_kv[name][3], new_kv[name][4]) for name in d_kv)
        assert collect_notifications(restarted, 1) == [b"r:1"]
        assert p.get_notifications() == []  # the old instance hears nothing
    finally:
        restarted.close()


def test_removing_a_peer_mid_copy_closes_its_handles_only_once_the_copy_settled(pair) -> None:
    p, d, d_ipc, p_kv, d_kv, _ = pair
    d_ipc.copy_delay_s = 0.3
    handle = d.read_blocks("engine-p", [1, 2], [7, 8], b"slow:1")
    d.remove_remote("engine-p")
    handle.release()  # a GPU copy cannot be recalled: it still runs to its end
    assert handle.poll() == TransferState.PENDING and d_ipc.closed == 0 and d.open_peers == 1
    wait_for(lambda: handle.poll() == TransferState.DONE, 5, "the copy to settle")
    assert d_ipc.closed == len(p_kv) and d.open_peers == 0
    assert all(torch.equal(d_kv[name][[1, 2]], p_kv[name][[7, 8]]) for name in d_kv)
    assert collect_notifications(p, 1) == [b"slow:1"]  # it did read: P may count this reader


def test_close_waits_for_copies_still_queued_before_it_unmaps_the_peers(pair) -> None:
    """Dropping an opened tensor unmaps the peer's memory, and torch's IPC deleter waits for the
    current stream only: close() must wait for the side stream's copies itself."""
    p, d, d_ipc, p_kv, _, _ = pair
    d.timeout_s, d_ipc.copy_delay_s = 0.05, 0.4  # the copy outlasts close()'s wait
    d.read_blocks("engine-p", [1], [2], b"slow:1")
    unmapped_when_waited = []
    synchronize = d_ipc.synchronize

    def recording_synchronize() -> None:
        unmapped_when_waited.append(d_ipc.closed)
        synchronize()

    d_ipc.synchronize = recording_synchronize  # type: ignore[method-assign]
    d.close()
    assert unmapped_when_waited == [0] and d_ipc.synchronized == 1
    assert d_ipc.closed == len(p_kv) and d.open_peers == 0


def test_an_ipc_handle_is_opened_on_the_exporter_s_device_index() -> None:
    """Under one visible GPU set a peer's memory may sit on another index than ours."""
    from kvrelay.kv_transfer.transport.ipc import exported_device

    shared = [1, b"handle", 4096, 0, b"ref", 0, b"event", True]  # _share_cuda_'s 8 fields, device 1
    assert exported_device(shared) == torch.device("cuda", 1)


def test_the_notification_waits_for_the_copy_not_for_the_poll(pair) -> None:
    p, d, d_ipc, _, _, _ = pair
    d_ipc.copy_delay_s = 0.2
    handle = d.read_blocks("engine-p", [1], [2], b"late:1")
    assert p.get_notifications() == []  # the copy has not settled yet
    assert collect_notifications(p, 1) == [b"late:1"]  # never polled, still notified
    assert finish(handle) == TransferState.DONE


def test_a_copy_that_fails_to_queue_errs_and_notifies_nobody(pair, monkeypatch) -> None:
    p, d, _, _, _, _ = pair

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr("kvrelay.kv_transfer.transport.cuda_ipc.copy_layer", broken)
    handle = d.read_blocks("engine-p", [0], [0], b"bad:1")
    assert finish(handle) == TransferState.ERROR
    assert "device lost" in (handle.error or "")
    assert collect_notifications(p, 0) == []


# --- refusals ---------------------------------------------------------------------------------

def test_a_peer_on_another_host_is_refused_naming_both_hosts(pair) -> None:
    p, d, _, _, _, layout = pair
    agent = msgspec.msgpack.decode(p.agent_metadata(), type=IpcAgent)
    agent.host = "other-box/boot"
    with pytest.raises(TransportError, match="other-box/boot.*one host"):
        d.add_remote("engine-x", msgspec.msgpack.encode(agent), layout)


def test_handles_that_cannot_be_opened_are_refused_and_nothing_stays_open(pair) -> None:
    p, d, d_ipc, _, _, layout = pair
    d_ipc.fail_open = True
    with pytest.raises(TransportError, match="cannot open the KV handles"):
        d.add_remote("engine-x", p.agent_metadata(), layout)
    assert d.open_peers == 1  # engine-p only


def test_another_transports_agent_blob_is_refused() -> None:
    d = CudaIpcTransport("engine-d", ipc=HostIpc())
    try:
        layout = d.register_kv_caches(kv_caches(seed=2))
        with pytest.raises(TransportError, match="backend 'cuda_ipc'"):
            d.add_remote("engine-p", b"127.0.0.1:5555", layout)
    finally:
        d.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: nothing to refuse")
def test_without_a_gpu_backend_cuda_ipc_is_refused_naming_the_problem() -> None:
    with pytest.raises(ValueError, match="needs a CUDA GPU.*sees none.*'tcp' or 'nixl'"):
        create_transport("cuda_ipc", "engine-p")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: nothing to refuse")
def test_serve_with_backend_cuda_ipc_and_no_gpu_exits_2_naming_the_problem(tmp_path) -> None:
    import json
    import subprocess
    import sys

    from tests.tiny import write_tiny_model_dir

    config = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_port": 29731,
              "kv_connector_extra_config": {"backend": "cuda_ipc"}}
    done = subprocess.run([sys.executable, "-m", "kvrelay.entrypoints.cli", "serve",
                           str(write_tiny_model_dir(tmp_path)), "--port", "0", "--kv-cache-memory", "4MiB",
                           "--kv-transfer-config", json.dumps(config)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stderr
    assert "backend 'cuda_ipc' needs a CUDA GPU" in done.stderr and "Traceback" not in done.stderr


def test_kv_in_host_memory_is_refused_by_the_cuda_seam() -> None:
    from kvrelay.kv_transfer.transport.ipc import require_gpu_kv

    with pytest.raises(ValueError, match="keeps its KV on cpu.*--device cuda"):
        require_gpu_kv("cpu")


# --- on a GPU ---------------------------------------------------------------------------------

def _serve_gpu_blocks(conn) -> None:  # pragma: no cover - runs in P's process on a GPU
    p = create_transport("cuda_ipc", "engine-p")
    p_kv = {name: kv.cuda() for name, kv in kv_caches(seed=1).items()}
    conn.send((p.agent_metadata(), p.register_kv_caches(p_kv)))
    conn.send(collect_notifications(p, 1, timeout_s=60))
    conn.recv()
    p.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: CUDA IPC shares GPU memory")
def test_on_a_gpu_d_copies_blocks_out_of_another_process_vram() -> None:
    import multiprocessing as mp

    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    proc = context.Process(target=_serve_gpu_blocks, args=(child,), daemon=True)
    proc.start()
    d = create_transport("cuda_ipc", "engine-d")
    try:
        d_kv = {name: kv.cuda() for name, kv in kv_caches(seed=2).items()}
        d.register_kv_caches(d_kv)
        assert parent.poll(120), "P's process did not start"
        agent, layout = parent.recv()
        d.add_remote("engine-p", agent, layout)
        assert finish(d.read_blocks("engine-p", [8, 9, 3], [0, 1, 11], b"gpu:1"), 30) == TransferState.DONE
        p_kv = kv_caches(seed=1)
        for name in d_kv:
            assert torch.equal(d_kv[name][[8, 9, 3]].cpu(), p_kv[name][[0, 1, 11]])
        assert parent.poll(60) and parent.recv() == [b"gpu:1"]
        parent.send("done")
    finally:
        d.close()
        proc.join(60)


def test_a_copy_that_fails_on_the_device_errs_and_notifies_nobody(pair, monkeypatch) -> None:
    p, d, d_ipc, _, _, _ = pair

    class Faulted:
        def query(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(d_ipc, "record", lambda: Faulted())
    handle = d.read_blocks("engine-p", [0], [0], b"faulted:1")
    assert finish(handle) == TransferState.ERROR and "illegal memory access" in (handle.error or "")
    assert collect_notifications(p, 0) == [] and d.open_peers == 1

"""Mooncake pieces of the benchmarks (bench_transfer.py, bench_offload.py): the raw Transfer
Engine read the transport is measured against, and a mooncake_master with a memory holder for
the store tier.

Importing this module does not import Mooncake; `mooncake_loads()` says whether it can.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

POLL_SLEEP_S = 0.0005  # kvrelay.engine.llm_engine.IDLE_STEP_SLEEP_S


def mooncake_loads() -> bool:
    from kvrelay.kv_transfer.transport.mooncake import mooncake_available

    return mooncake_available()[0]


def raw_mooncake_once(case: Any) -> tuple[Callable[[], float], Callable[[], None]]:
    """A minimal direct Transfer Engine script: two engines on loopback (P2PHANDSHAKE, tcp), each
    layer's tensor registered, and one batch_transfer_sync_read of the case's blocks: one entry per
    layer, as P's and D's blocks are each one contiguous run. Same bytes as the transport moves.
    Returns `once() -> seconds` (one read; the first one also connects) and `close()`."""
    from mooncake.engine import TransferEngine

    p, d = TransferEngine(), TransferEngine()
    for engine in (p, d):
        if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("the Transfer Engine did not start")
    for engine, kv in ((p, case.p_kv), (d, case.d_kv)):
        for layer in kv.values():
            engine.register_memory(layer.data_ptr(), layer.numel() * layer.element_size())
    peer = f"127.0.0.1:{p.get_rpc_port()}"
    block_bytes = case.num_bytes // len(case.remote_block_ids) // len(case.p_kv)
    length = block_bytes * len(case.remote_block_ids)
    local = [kv.data_ptr() + case.local_block_ids[0] * block_bytes for kv in case.d_kv.values()]
    remote = [kv.data_ptr() + case.remote_block_ids[0] * block_bytes for kv in case.p_kv.values()]

    def once() -> float:
        start = time.perf_counter()
        rc = d.batch_transfer_sync_read(peer, local, remote, [length] * len(local))
        elapsed = time.perf_counter() - start
        if rc != 0:
            raise RuntimeError(f"raw Transfer Engine read failed (rc {rc})")
        return elapsed

    def close() -> None:
        for engine, kv in ((p, case.p_kv), (d, case.d_kv)):
            for layer in kv.values():
                engine.unregister_memory(layer.data_ptr())

    once()  # the first read connects: not part of any round
    return once, close


class MooncakeStoreForBench:
    """mooncake_master on a free loopback port plus one client lending `segment` of memory: the
    store's memory lives as long as this object, not as long as the engines that write to it
    (they join with segment=0, as engines beside a dedicated store node would)."""

    def __init__(self, segment: str = "2GiB") -> None:
        binary = shutil.which("mooncake_master", path=os.path.dirname(sys.executable)) or shutil.which(
            "mooncake_master")
        if binary is None:
            raise SystemExit("mooncake_master not found: pip install 'kvrelay[mooncake]'")
        ports = []
        for _ in range(2):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                ports.append(s.getsockname()[1])
        self.port = ports[0]
        self.process = subprocess.Popen(
            [binary, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1", f"--metrics_port={ports[1]}",
             "--enable_metric_reporting=false"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_listening()
        from kvrelay.kv_transfer.offload import OffloadStats
        from kvrelay.kv_transfer.offload.tiers.mooncake_store import MooncakeStoreTier

        self.holder = MooncakeStoreTier(f"mooncakestore://127.0.0.1:{self.port}?segment={segment}",
                                        OffloadStats())

    def _wait_listening(self) -> None:
        for _ in range(400):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise SystemExit("mooncake_master did not start")

    def url(self, buffer: str = "256MiB") -> str:
        """The URL an engine uses: no segment of its own, a local buffer for batched reads."""
        return f"mooncakestore://127.0.0.1:{self.port}?segment=0&buffer={buffer}"

    def close(self) -> None:
        self.holder.close()
        self.process.terminate()
        self.process.wait(10)



def interleaved_mooncake(case: Any, reps: int,
                         check_copied: Callable[[Any], None]) -> tuple[float, float, float]:
    """Median seconds of MooncakeTransport.read_blocks and of the raw Transfer Engine read of the
    same bytes, alternated read by read on the same tensors, and the median of each adjacent
    pair's ratio raw / ours (a pair shares the machine's load of the moment)."""
    from mooncake.engine import TransferEngine

    from kvrelay.kv_transfer.transport import TransferState, create_transport

    p, d = create_transport("mooncake", "bench-p"), create_transport("mooncake", "bench-d")
    raw_p, raw_d = TransferEngine(), TransferEngine()
    try:
        d.add_remote("bench-p", p.agent_metadata(), p.register_kv_caches(case.p_kv))
        d.register_kv_caches(case.d_kv)
        for engine, kv in ((raw_p, case.p_kv), (raw_d, case.d_kv)):
            engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
            for layer in kv.values():
                engine.register_memory(layer.data_ptr(), layer.numel() * layer.element_size())
        peer = f"127.0.0.1:{raw_p.get_rpc_port()}"
        block_bytes = case.num_bytes // len(case.remote_block_ids) // len(case.p_kv)
        local = [kv.data_ptr() + case.local_block_ids[0] * block_bytes for kv in case.d_kv.values()]
        remote = [kv.data_ptr() + case.remote_block_ids[0] * block_bytes for kv in case.p_kv.values()]
        lengths = [block_bytes * len(case.remote_block_ids)] * len(local)
        ours, raw = [], []

        def read_ours(i: int) -> None:
            start = time.perf_counter()
            handle = d.read_blocks("bench-p", case.local_block_ids, case.remote_block_ids, f"r{i}:1".encode())
            while handle.poll() == TransferState.PENDING:
                time.sleep(POLL_SLEEP_S)  # as an engine's step loop polls: it does not spin
            ours.append(time.perf_counter() - start)
            if handle.poll() != TransferState.DONE:
                raise RuntimeError(f"mooncake read failed: {handle.error}")

        def read_raw() -> None:
            start = time.perf_counter()
            if raw_d.batch_transfer_sync_read(peer, local, remote, lengths) != 0:
                raise RuntimeError("raw Transfer Engine read failed")
            raw.append(time.perf_counter() - start)

        for i in range(reps + 1):  # the first pair connects: not timed
            # NOTE: which read goes first alternates, so neither always follows the other's tail
            for ours_now in ((True, False) if i % 2 == 0 else (False, True)):
                for layer in case.d_kv.values():
                    layer[case.local_block_ids] = 0  # each read proves its own copy
                read_ours(i) if ours_now else read_raw()
                check_copied(case)
        ratios = [r / o for o, r in zip(ours[1:], raw[1:], strict=True)]
        return statistics.median(ours[1:]), statistics.median(raw[1:]), statistics.median(ratios)
    finally:
        d.close()
        p.close()

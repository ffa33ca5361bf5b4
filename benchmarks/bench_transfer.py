"""KV transfer throughput: each transport and the connector's pull against the raw path below.

For prompts of 512 to 8192 tokens in the SmolLM2-135M KV layout (30 layers, 3 KV heads, head
dim 64, fp32) and block sizes 16 and 64, moves the prompt's blocks P -> D in one process with:

    nixl        NixlTransport.read_blocks            vs  raw nixl: one prepped READ, busy polled
    conn nixl   the NixlConnector worker path over NIXL (verify_checksum off): D's start_load_kv
                -> pin over the authenticated side channel -> read -> finished_recving
    conn+cksum  the same with verify_checksum on: P digests the blocks at pin time, D after the read
    tcp         TcpTransport.read_blocks             vs  raw socket: sendall / recv_into, same bytes
    conn tcp    the NixlConnector worker path over the TCP backend (verify_checksum off)
    mooncake    MooncakeTransport.read_blocks        vs  raw mooncake: two Transfer Engines (tcp,
                P2PHANDSHAKE), one batch_transfer_sync_read of the same bytes (mooncake_bench.py)
    conn mc     the NixlConnector worker path over the mooncake backend (verify_checksum off)
    memcpy      torch copy_ of the same block slices (the ceiling)
    digest      security.block_digests over the blocks alone (the checksum's own throughput)

and prints GB/s with the ratios the targets name (nixl and conn nixl >= 0.8 x raw nixl, tcp and
conn tcp >= 0.8 x raw socket, conn+cksum >= 0.6 x raw nixl, mooncake and conn mc >= 0.8 x raw
mc; the Mooncake columns where the wheel loads), then plots them (--plot). Each
column opens a `Session` over a case; the columns' transfers alternate round by round
(`measure_case`); GB/s is each column's best round, and a ratio is the median over rounds of
the ratio within a round (`paired_ratio`), so a path and its baseline are compared on the same
second of this shared machine.
With --ttft it also times the first token of 1024- and 4096-token prompts through `kvrelay up`
(1P1D) against one `kvrelay serve` with the same total threads (see transfer_ttft.py).

    .venv/bin/python benchmarks/bench_transfer.py [--tokens 512 2048 8192] [--block-sizes 16 64] \
        [--ttft] [--plot docs/benchmarks/bench_transfer.png]
    .venv/bin/python benchmarks/bench_transfer.py --quick --ttft      # a couple of minutes
    .venv/bin/python benchmarks/bench_transfer.py --gpu               # the GPU paths (transfer_gpu.py)
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import plotting  # benchmarks/plotting.py, beside this script
import torch
from hostinfo import cpu_summary  # benchmarks/hostinfo.py
from mooncake_bench import (  # benchmarks/mooncake_bench.py
    interleaved_mooncake,
    mooncake_loads,
    raw_mooncake_once,
)

from kvrelay.engine.llm_engine import IDLE_STEP_SLEEP_S
from kvrelay.kv_transfer import wakeup
from kvrelay.kv_transfer.base import KVCacheSpec
from kvrelay.kv_transfer.config import KVTransferConfig
from kvrelay.kv_transfer.p2p import security
from kvrelay.kv_transfer.p2p.lease_ids import make_lease_id
from kvrelay.kv_transfer.pull.connector import NixlConfig
from kvrelay.kv_transfer.pull.meta import LeaseSpec, NixlConnectorMetadata, PullSpec
from kvrelay.kv_transfer.pull.worker import NixlWorker
from kvrelay.kv_transfer.transport import TransferState, create_transport, nixl_available
from kvrelay.kv_transfer.transport.base import describe_kv_caches
from kvrelay.utils import cdiv

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, DTYPE = 30, 3, 64, torch.float32  # SmolLM2-135M


@dataclass
class Case:
    """One prompt's transfer: P's and D's KV pools and the blocks to move."""

    num_tokens: int
    block_size: int
    p_kv: dict[str, torch.Tensor]
    d_kv: dict[str, torch.Tensor]
    remote_block_ids: list[int] = field(default_factory=list)
    local_block_ids: list[int] = field(default_factory=list)

    @property
    def num_bytes(self) -> int:
        return describe_kv_caches(self.p_kv).block_bytes * len(self.remote_block_ids) * NUM_LAYERS


def make_pools(block_size: int, num_blocks: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    shape = (num_blocks, 2, NUM_KV_HEADS, block_size, HEAD_DIM)  # [num_blocks, 2, H_kv, block_size, D]
    p_kv = {f"model.layers.{i}.self_attn": torch.rand(shape, dtype=DTYPE) for i in range(NUM_LAYERS)}
    d_kv = {name: torch.zeros(shape, dtype=DTYPE) for name in p_kv}
    return p_kv, d_kv


def make_case(num_tokens: int, block_size: int, p_kv: dict[str, torch.Tensor],
              d_kv: dict[str, torch.Tensor]) -> Case:
    # NOTE: P's blocks from the start of its pool, D's from the end: both runs contiguous, as
    # a fresh allocation mostly is.
    num_blocks = cdiv(num_tokens, block_size)
    pool = next(iter(p_kv.values())).shape[0]
    return Case(num_tokens, block_size, p_kv, d_kv, remote_block_ids=list(range(num_blocks)),
                local_block_ids=list(range(pool - num_blocks, pool)))


# --- measurements: each column opens a session over a case; a session's `once()` times one transfer

@dataclass
class Session:
    """One column's set-up over a case: `once()` moves the case's blocks and returns the seconds
    it took; `close()` tears the set-up down. Sessions of all columns are open together, so that
    their transfers can alternate (see `measure_case`)."""

    once: Callable[[], float]
    close: Callable[[], None] = lambda: None
    writes_d_kv: bool = True  # whether `once` fills the case's D blocks (checked after it)


Column = Callable[[Case], Session]


def transport_column(name: str) -> Column:
    def open_session(case: Case) -> Session:
        p = create_transport(name, "bench-p")
        d = create_transport(name, "bench-d")
        layout = p.register_kv_caches(case.p_kv)
        d.register_kv_caches(case.d_kv)
        d.add_remote("bench-p", p.agent_metadata(), layout)
        reads = iter(range(1 << 30))

        def once() -> float:
            start = time.perf_counter()
            handle = d.read_blocks("bench-p", case.local_block_ids, case.remote_block_ids,
                                   f"r{next(reads)}:1".encode())
            while (state := handle.poll()) == TransferState.PENDING:
                time.sleep(0)
            elapsed = time.perf_counter() - start
            handle.release()
            if state != TransferState.DONE:
                raise RuntimeError(f"{name} read failed: {handle.error}")
            return elapsed

        def close() -> None:
            d.close()
            p.close()
        return Session(once, close)
    return open_session


def raw_nixl_column(case: Case) -> Session:
    """A minimal direct NIXL script: two agents, descriptors per (layer, block), one prepped
    READ of the case's blocks, both workers busy polled."""
    from kvrelay.kv_transfer.transport.nixl import block_descriptors, descriptor_indices, import_nixl

    api = import_nixl()
    config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    p, d = api.nixl_agent("raw-p", config), api.nixl_agent("raw-d", config)
    p_layout, d_layout = describe_kv_caches(case.p_kv), describe_kv_caches(case.d_kv)
    p.register_memory(list(case.p_kv.values()))
    d.register_memory(list(case.d_kv.values()))
    remote_name = d.add_remote_agent(p.get_agent_metadata())
    local = d.prep_xfer_dlist("NIXL_INIT_AGENT", block_descriptors(d_layout), "DRAM")
    remote = d.prep_xfer_dlist(remote_name, block_descriptors(p_layout), "DRAM")
    local_idx = descriptor_indices(case.local_block_ids, NUM_LAYERS, d_layout.num_blocks)
    remote_idx = descriptor_indices(case.remote_block_ids, NUM_LAYERS, p_layout.num_blocks)

    def once() -> float:
        start = time.perf_counter()
        xfer = d.make_prepped_xfer("READ", local, local_idx, remote, remote_idx, b"raw")
        state = d.transfer(xfer)
        while state == "PROC":
            p.get_new_notifs()
            state = d.check_xfer_state(xfer)
        elapsed = time.perf_counter() - start
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ ended in {state}")
        xfer.release()
        return elapsed

    def close() -> None:
        local.release()
        remote.release()
        d.remove_remote_agent(remote_name)
    return Session(once, close)


def raw_socket_column(case: Case) -> Session:
    """The case's bytes over a loopback TCP connection, one sendall and recv_into loop.

    The source is a copy of P's blocks and the destination is zero-filled, so both are resident
    memory like the KV pools. (Until 2026-12-03 both were `torch.empty`: an untouched source reads
    as the kernel's one shared zero page, always in cache, which made the baseline 5-20% faster
    than any real send of the same size.)"""
    src = torch.cat([layer[case.remote_block_ids].reshape(-1).view(torch.uint8)
                     for layer in case.p_kv.values()])
    dst = torch.zeros(case.num_bytes, dtype=torch.uint8)
    assert src.numel() == case.num_bytes
    send_view, recv_view = memoryview(src.numpy()), memoryview(dst.numpy())  # type: ignore[arg-type]
    listener = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(listener.getsockname()[:2])
    receiver, _ = listener.accept()

    def once() -> float:
        thread = threading.Thread(target=sender.sendall, args=(send_view,))
        start = time.perf_counter()
        thread.start()
        received = 0
        while received < len(recv_view):
            received += receiver.recv_into(recv_view[received:])
        thread.join()
        return time.perf_counter() - start

    def close() -> None:
        for sock in (sender, receiver, listener):
            sock.close()
        if not torch.equal(src, dst):
            raise RuntimeError("raw socket: the bytes received differ from the bytes sent")
    return Session(once, close, writes_d_kv=False)


def memcpy_column(case: Case) -> Session:
    n = len(case.remote_block_ids)
    r0, l0 = case.remote_block_ids[0], case.local_block_ids[0]

    def once() -> float:
        start = time.perf_counter()
        for name, p_layer in case.p_kv.items():
            case.d_kv[name][l0:l0 + n].copy_(p_layer[r0:r0 + n])
        return time.perf_counter() - start
    return Session(once)


# --- the connector's path: P's and D's NixlWorker, driven as two engines' runners drive them ---

class ConnectorPair:
    """A prefill and a decode NixlWorker over the case's pools, as two engines' runners hold them.

    Each pull is what a request's KV costs on D's side of the connector: the scheduler-side
    metadata hands P a lease and D a pull (LeaseSpec / PullSpec, as NixlScheduler builds them),
    then D's worker pins the lease over the authenticated ZMQ side channel (P checks it and, with
    verify_checksum, computes the blocks' digests), reads the blocks through the transport with
    the descriptors prepared at the handshake, verifies the digests, and reports the request in
    finished_recving; P's worker takes the notification and ends the lease. Both workers are
    polled from this thread (get_finished), as each engine's step loop would: an engine whose
    only work is transfers in flight sleeps up to `IDLE_STEP_SLEEP_S` after each empty step,
    woken early when a connector thread has news (`kv_transfer.wakeup`), so this loop does too
    (a loop that spins would take a core from the transfer's own threads, which no engine does).
    """

    def __init__(self, backend: str, verify_checksum: bool, case: Case, secret_file: str) -> None:
        extra = {"backend": backend, "verify_checksum": verify_checksum, "secret_file": secret_file}
        nixl_config = NixlConfig.from_extra_config(extra)
        keys = security.load_keys(secret_file)
        fingerprint = {"architecture": "LlamaForCausalLM", "num_layers": NUM_LAYERS,
                       "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "dtype": "float32"}
        kv_spec = KVCacheSpec(case.block_size, NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, "float32",
                              layer_names=tuple(case.p_kv), fingerprint=fingerprint)
        self.p_config, self.d_config = (
            KVTransferConfig(kv_connector="NixlConnector", kv_role=role, engine_id=f"bench-{role}",
                             kv_port=_free_port(), kv_connector_extra_config=extra)
            for role in ("kv_producer", "kv_consumer"))
        self.p = NixlWorker(self.p_config, nixl_config, keys, kv_spec)
        self.d = NixlWorker(self.d_config, nixl_config, keys, kv_spec)
        self.p.register_kv_caches(case.p_kv)
        self.d.register_kv_caches(case.d_kv)
        self.num_pulls = 0

    def pull(self, case: Case) -> float:
        """Seconds from D's start_load_kv to the request in D's finished_recving."""
        self.num_pulls += 1
        p_req, d_req = f"p-{self.num_pulls}", f"d-{self.num_pulls}"
        prompt_digest = security.prompt_digest([self.num_pulls] * case.num_tokens)
        now_ms = int(time.time() * 1000)
        lease = LeaseSpec(req_id=p_req, lease_id=make_lease_id(now_ms), block_ids=case.remote_block_ids,
                          prompt_digest=prompt_digest, expiry_ms=now_ms + 30_000)
        self.p.start_load_kv(NixlConnectorMetadata(leases=[lease]))  # P's step after the prefill
        pull = PullSpec(req_id=d_req, remote_request_id=p_req, remote_engine_id=self.p_config.engine_id,
                        remote_host=self.p_config.kv_ip, remote_port=self.p_config.kv_port,
                        lease_id=lease.lease_id, prompt_digest=prompt_digest,
                        local_block_ids=case.local_block_ids, remote_block_ids=case.remote_block_ids)
        sent: set[str] = set()
        start = time.perf_counter()
        self.d.start_load_kv(NixlConnectorMetadata(pulls=[pull]))
        while True:
            received = self.d.get_finished()
            sent |= self.p.get_finished().finished_sending
            if d_req in received.finished_recving:
                break
            if received.failed_recving or received.invalid_block_ids:
                raise RuntimeError(f"the connector's pull failed ({received.stats}); see the log above")
            wakeup.wait(IDLE_STEP_SLEEP_S)
        elapsed = time.perf_counter() - start
        if received.invalid_block_ids:
            raise RuntimeError(f"blocks {sorted(received.invalid_block_ids)} failed their checksum")
        self._wait_lease_ended(p_req, sent)
        return elapsed

    def _wait_lease_ended(self, p_req: str, sent: set[str], timeout_s: float = 10.0) -> None:
        """P frees the blocks once the read's notification arrived: no lease may be left over."""
        deadline = time.monotonic() + timeout_s
        while p_req not in sent:
            sent |= self.p.get_finished().finished_sending
            if time.monotonic() > deadline:
                raise RuntimeError(f"P never saw the notification of {p_req}")
            time.sleep(0.0005)

    def close(self) -> None:
        self.d.close()
        self.p.close()


def connector_column(backend: str, verify_checksum: bool, secret_file: str) -> Column:
    def open_session(case: Case) -> Session:
        pair = ConnectorPair(backend, verify_checksum, case, secret_file)
        return Session(lambda: pair.pull(case), pair.close)
    return open_session


def digest_column(case: Case) -> Session:
    """security.block_digests over the case's blocks: what P pays at pin time and D after the read."""
    layers = list(case.p_kv.values())

    def once() -> float:
        start = time.perf_counter()
        security.block_digests(layers, case.remote_block_ids)
        return time.perf_counter() - start
    return Session(once, writes_d_kv=False)


def raw_mooncake_column(case: Case) -> Session:
    """Two Transfer Engines and one batch_transfer_sync_read of the case's bytes (mooncake_bench.py)."""
    once, close = raw_mooncake_once(case)
    return Session(once, close)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _clear_d_blocks(case: Case) -> None:
    for d_layer in case.d_kv.values():
        d_layer[case.local_block_ids] = 0  # so the next transfer proves its own copy


def _check_copied(case: Case, column: str) -> None:
    for name, p_layer in case.p_kv.items():
        if not torch.equal(case.d_kv[name][case.local_block_ids], p_layer[case.remote_block_ids]):
            raise RuntimeError(f"{column}, layer {name}: the blocks read differ from P's")


# --- the table ------------------------------------------------------------------------------

def build_columns(secret_file: str) -> dict[str, Column]:
    columns: dict[str, Column] = {}
    if nixl_available():
        columns["nixl"] = transport_column("nixl")
        columns["conn nixl"] = connector_column("nixl", False, secret_file)
        columns["conn+cksum"] = connector_column("nixl", True, secret_file)
        columns["raw nixl"] = raw_nixl_column
    columns["tcp"] = transport_column("tcp")
    columns["conn tcp"] = connector_column("tcp", False, secret_file)
    if not nixl_available():
        columns["conn+cksum"] = connector_column("tcp", True, secret_file)
    columns["raw socket"] = raw_socket_column
    if mooncake_loads():
        columns["mooncake"] = transport_column("mooncake")
        columns["conn mc"] = connector_column("mooncake", False, secret_file)
        columns["raw mc"] = raw_mooncake_column
    columns["memcpy"] = memcpy_column
    columns["digest"] = digest_column
    return columns


# name: (numerator column, denominator column, target)
RATIOS = {"nixl/raw": ("nixl", "raw nixl", 0.8), "tcp/raw": ("tcp", "raw socket", 0.8),
          "connN/raw": ("conn nixl", "raw nixl", 0.8), "connT/raw": ("conn tcp", "raw socket", 0.8),
          "cksum/raw": ("conn+cksum", "raw nixl", 0.6), "mc/raw": ("mooncake", "raw mc", 0.8),
          "connM/raw": ("conn mc", "raw mc", 0.8)}


def run(tokens: list[int], block_sizes: list[int], reps: int,
        only: list[str] | None = None) -> list[dict[str, float | int]]:
    """The table's rows; `only`: the columns to measure (default: all there are here)."""
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-") as tmp:
        secret_file = Path(tmp) / "kv-secret"  # NOTE: as `kvrelay up`: an authenticated cluster
        secret_file.write_text(secrets.token_hex(32))
        columns = build_columns(str(secret_file))
        unknown = sorted(set(only or ()) - set(columns))
        if unknown:
            raise SystemExit(f"unknown or unavailable column(s) {unknown}; here: {list(columns)}")
        if only:
            columns = {name: column for name, column in columns.items() if name in only}
        return run_columns(columns, tokens, block_sizes, reps)


def measure_case(columns: dict[str, Column], case: Case, reps: int) -> dict[str, list[float]]:
    """Seconds of each timed transfer of the case per column, round by round (`reps` rounds).

    Every column's session is opened first; then the columns take turns, one transfer each per
    round, in an order that rotates each round, so that a path and its raw baseline are timed
    within a fraction of a second of each other (this shared VM's speed drifts by 10% and more
    within a minute; one column's reps after another's would compare different minutes). The
    first round connects and handshakes: not timed. In the first and the last round every
    column that writes D's blocks finds them zeroed and is checked to have copied P's."""
    sessions: dict[str, Session] = {}
    try:
        for name, open_session in columns.items():
            sessions[name] = open_session(case)
        times: dict[str, list[float]] = {name: [] for name in sessions}
        names = list(sessions)
        for round_ in range(reps + 1):
            checked = round_ in (0, reps)
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                session = sessions[name]
                if checked and session.writes_d_kv:
                    _clear_d_blocks(case)
                elapsed = session.once()
                if checked and session.writes_d_kv:
                    _check_copied(case, name)
                if round_:
                    times[name].append(elapsed)
        return times
    finally:
        for session in sessions.values():
            session.close()


def paired_ratio(num_seconds: list[float], den_seconds: list[float]) -> float:
    """Throughput of a path over its baseline: the median over rounds of the ratio within each
    round, whose two transfers ran within a second of each other. Each column's best round (its
    GB/s in the table) may fall in different minutes of a busy machine; a round's pair may not."""
    return statistics.median(den / num for num, den in zip(num_seconds, den_seconds, strict=True))


def run_columns(columns: dict[str, Column], tokens: list[int], block_sizes: list[int],
                reps: int) -> list[dict[str, float | int]]:
    rows: list[dict[str, float | int]] = []
    for block_size in block_sizes:
        pool_blocks = 2 * cdiv(max(tokens), block_size)
        p_kv, d_kv = make_pools(block_size, pool_blocks)
        for num_tokens in tokens:
            case = make_case(num_tokens, block_size, p_kv, d_kv)
            row: dict[str, float | int] = {"block_size": block_size, "tokens": num_tokens,
                                           "MB": case.num_bytes / 1e6}
            times = measure_case(columns, case, reps)
            for column, seconds in times.items():
                row[column] = case.num_bytes / min(seconds) / 1e9
            for ratio, (num, den, _) in RATIOS.items():
                if num in times and den in times:
                    row[ratio] = paired_ratio(times[num], times[den])
            rows.append(row)
            print_table(rows[-1:], header=len(rows) == 1)
    return rows


def print_table(rows: list[dict[str, float | int]], header: bool = True) -> None:
    keys = list(rows[0])
    if header:
        print("  ".join(f"{k:>10}" for k in keys))
    for row in rows:
        print("  ".join(f"{row[k]:>10.2f}" if isinstance(row[k], float) else f"{row[k]:>10}" for k in keys),
              flush=True)


def summarize(rows: list[dict[str, float | int]]) -> None:
    for ratio, (_, _, target) in RATIOS.items():
        values = [float(r[ratio]) for r in rows if ratio in r]
        if values:
            print(f"{ratio}: median {statistics.median(values):.2f}, min {min(values):.2f} "
                  f"(target >= {target})")


QUICK = {"tokens": [512, 2048], "block_sizes": [16], "reps": 2, "ttft_sizes": [1024], "ttft_reps": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--reps", type=int, default=5, help="timed transfers per cell (the best is kept)")
    parser.add_argument("--columns", nargs="+", default=None,
                        help="measure only these columns, e.g. --columns tcp 'conn tcp' 'raw socket'")
    parser.add_argument("--quick", action="store_true",
                        help=f"a reduced run in a couple of minutes: {QUICK}")
    parser.add_argument("--ttft", action="store_true",
                        help="also time the first token through `kvrelay up` (1P1D) and one `kvrelay serve`")
    parser.add_argument("--ttft-sizes", type=int, nargs="+", default=[1024, 4096], help="prompt tokens")
    parser.add_argument("--ttft-reps", type=int, default=3,
                        help="timed requests per size (the median is kept)")
    parser.add_argument("--threads", type=int, default=None,
                        help="--ttft: total torch threads of each target (default: every core)")
    parser.add_argument("--mooncake-only", action="store_true",
                        help="only the interleaved mooncake / raw Transfer Engine table")
    parser.add_argument("--plot", type=Path, default=Path("docs/benchmarks/bench_transfer.png"),
                        help="where the throughput plot goes")
    parser.add_argument("--gpu", action="store_true",
                        help="the GPU columns instead (cuda_ipc, NIXL on VRAM, host staging against the "
                             "device's block copy; benchmarks/transfer_gpu.py)")
    parser.add_argument("--gpu-device", default="cuda",
                        help="--gpu: the device (cpu: a dry run of the same code on host memory)")
    parser.add_argument("--markdown", type=Path, default=None, help="--gpu: also write the table here")
    parser.add_argument("--layout", default="smollm2-135m", choices=("smollm2-135m", "llama-8b"),
                        help="--gpu: the KV layout (llama-8b at 4096 tokens, block size 16: issue 33's "
                             "512 MiB block set)")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NOTE: NIXL's INFO lines would cut the table
    if args.gpu:
        from transfer_gpu import run_gpu  # benchmarks/transfer_gpu.py

        raise SystemExit(run_gpu(args.tokens, args.block_sizes, args.reps, args.gpu_device, args.markdown,
                                 args.layout))
    print(cpu_summary())
    print("throughput in GB/s (SmolLM2 layout: 30 layers x 3 KV heads x 64 dims, fp32); "
          "conn* = the NixlConnector worker path (pin + read + notification), +cksum with "
          "verify_checksum; digest = security.block_digests alone")
    rows = run(args.tokens, args.block_sizes, args.reps, args.columns) if not args.mooncake_only else []
    if rows:
        summarize(rows)
    if mooncake_loads():
        print_mooncake_interleaved(args.tokens, args.block_sizes, max(args.reps, 5))
    if not rows:
        return
    plot(rows, args.plot)
    if args.ttft:
        from transfer_ttft import bench_ttft, print_ttft_table

        print_ttft_table(bench_ttft(args.ttft_sizes, args.ttft_reps, args.threads))


def print_mooncake_interleaved(tokens: list[int], block_sizes: list[int], reps: int) -> None:
    """The mooncake backend against raw Transfer Engine reads of the same bytes, alternated read
    by read (medians): the ratio the issue's target names, less exposed to the machine's load
    than the columns above, which are measured one after the other."""
    print(f"\nmooncake transport vs raw Transfer Engine, interleaved, medians of {reps} (GB/s; ratio: median "
          "of each pair's mooncake / raw; target >= 0.8)")
    print(f"{'block':>6} {'tokens':>7} {'MB':>8} {'mooncake':>9} {'raw mc':>8} {'ratio':>6}")
    for block_size in block_sizes:
        p_kv, d_kv = make_pools(block_size, 2 * cdiv(max(tokens), block_size))
        for num_tokens in tokens:
            case = make_case(num_tokens, block_size, p_kv, d_kv)
            ours, raw, ratio = interleaved_mooncake(case, reps, lambda c: _check_copied(c, "mooncake"))
            gb = case.num_bytes / 1e9
            print(f"{block_size:>6} {num_tokens:>7} {case.num_bytes / 1e6:>8.1f} {gb / ours:>9.2f} "
                  f"{gb / raw:>8.2f} {ratio:>6.2f}", flush=True)


def plot(rows: list[dict[str, float | int]], path: Path) -> None:
    """Throughput against prompt tokens, one line per column, one panel per block size."""
    plt = plotting.pyplot(path)
    if plt is None:
        return

    block_sizes = sorted({int(r["block_size"]) for r in rows})
    columns = [k for k in rows[0] if k not in ("block_size", "tokens", "MB") and k not in RATIOS]
    fig, axes = plt.subplots(1, len(block_sizes), figsize=(6 * len(block_sizes), 4.5), squeeze=False)
    for ax, block_size in zip(axes[0], block_sizes, strict=True):
        mine = [r for r in rows if r["block_size"] == block_size]
        for column in columns:
            style = "--" if column.startswith(("raw", "memcpy", "digest")) else "-o"
            ax.plot([r["tokens"] for r in mine], [r[column] for r in mine], style, label=column)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("GB/s")
        ax.set_title(f"block size {block_size}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    plotting.save(plt, fig, "KV transfer throughput, SmolLM2-135M layout (one process, loopback)", path)


if __name__ == "__main__":
    main()

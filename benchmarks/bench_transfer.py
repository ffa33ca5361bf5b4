"""KV transfer throughput: each transport's read_blocks against the raw path it is built on.

For prompts of 512 to 8192 tokens in the SmolLM2-135M KV layout (30 layers, 3 KV heads, head
dim 64, fp32) and block sizes 16 and 64, moves the prompt's blocks P -> D in one process with:

    nixl      NixlTransport.read_blocks               vs  raw nixl: one prepped READ, busy polled
    tcp       TcpTransport.read_blocks                vs  raw socket: sendall / recv_into, same bytes
    memcpy    torch copy_ of the same block slices (the ceiling)

and prints GB/s with the ratios the targets name (nixl >= 0.8 x raw nixl, tcp >= 0.7 x raw
socket). Each measurement is a function `measure_*(case) -> seconds` so more columns (e.g.
with checksums) and other parts (TTFT) can be added beside them.

    .venv/bin/python benchmarks/bench_transfer.py [--tokens 512 2048 8192] [--block-sizes 16 64]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvrelay.kv_transfer.transport import TransferState, create_transport, nixl_available
from kvrelay.kv_transfer.transport.base import describe_kv_caches

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
    num_blocks = -(-num_tokens // block_size)
    pool = next(iter(p_kv.values())).shape[0]
    return Case(num_tokens, block_size, p_kv, d_kv, remote_block_ids=list(range(num_blocks)),
                local_block_ids=list(range(pool - num_blocks, pool)))


# --- measurements: each returns the seconds one transfer of the case took -------------------

def measure_transport(name: str, reps: int) -> Callable[[Case], float]:
    def measure(case: Case) -> float:
        p = create_transport(name, "bench-p")
        d = create_transport(name, "bench-d")
        try:
            layout = p.register_kv_caches(case.p_kv)
            d.register_kv_caches(case.d_kv)
            d.add_remote("bench-p", p.agent_metadata(), layout)
            times = []
            for i in range(reps + 1):  # the first read connects: not timed
                start = time.perf_counter()
                handle = d.read_blocks("bench-p", case.local_block_ids, case.remote_block_ids,
                                       f"r{i}:1".encode())
                while (state := handle.poll()) == TransferState.PENDING:
                    time.sleep(0)
                times.append(time.perf_counter() - start)
                handle.release()
                if state != TransferState.DONE:
                    raise RuntimeError(f"{name} read failed: {handle.error}")
            _check_copied(case)
            return min(times[1:])
        finally:
            d.close()
            p.close()
    return measure


def measure_raw_nixl(reps: int) -> Callable[[Case], float]:
    """A minimal direct NIXL script: two agents, descriptors per (layer, block), one prepped
    READ of the case's blocks, both workers busy polled."""
    from kvrelay.kv_transfer.transport.nixl import block_descriptors, descriptor_indices, import_nixl

    def measure(case: Case) -> float:
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
        times = []
        for _ in range(reps + 1):
            start = time.perf_counter()
            xfer = d.make_prepped_xfer("READ", local, local_idx, remote, remote_idx, b"raw")
            state = d.transfer(xfer)
            while state == "PROC":
                p.get_new_notifs()
                state = d.check_xfer_state(xfer)
            times.append(time.perf_counter() - start)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL READ ended in {state}")
            xfer.release()
        _check_copied(case)
        local.release()
        remote.release()
        d.remove_remote_agent(remote_name)
        return min(times[1:])
    return measure


def measure_raw_socket(reps: int) -> Callable[[Case], float]:
    """The same byte count over a loopback TCP connection, one sendall and recv_into loop."""
    def measure(case: Case) -> float:
        src = torch.empty(case.num_bytes, dtype=torch.uint8)
        dst = torch.empty(case.num_bytes, dtype=torch.uint8)
        send_view, recv_view = memoryview(src.numpy()), memoryview(dst.numpy())
        listener = socket.create_server(("127.0.0.1", 0))
        sender = socket.create_connection(listener.getsockname()[:2])
        receiver, _ = listener.accept()
        times = []
        for _ in range(reps + 1):
            thread = threading.Thread(target=sender.sendall, args=(send_view,))
            start = time.perf_counter()
            thread.start()
            received = 0
            while received < len(recv_view):
                received += receiver.recv_into(recv_view[received:])
            thread.join()
            times.append(time.perf_counter() - start)
        for sock in (sender, receiver, listener):
            sock.close()
        return min(times[1:])
    return measure


def measure_memcpy(reps: int) -> Callable[[Case], float]:
    def measure(case: Case) -> float:
        n = len(case.remote_block_ids)
        r0, l0 = case.remote_block_ids[0], case.local_block_ids[0]
        times = []
        for _ in range(reps + 1):
            start = time.perf_counter()
            for name, p_layer in case.p_kv.items():
                case.d_kv[name][l0:l0 + n].copy_(p_layer[r0:r0 + n])
            times.append(time.perf_counter() - start)
        return min(times[1:])
    return measure


def _check_copied(case: Case) -> None:
    for name, p_layer in case.p_kv.items():
        if not torch.equal(case.d_kv[name][case.local_block_ids], p_layer[case.remote_block_ids]):
            raise RuntimeError(f"layer {name}: the blocks read differ from P's")
    for d_layer in case.d_kv.values():
        d_layer[case.local_block_ids] = 0  # so the next measurement proves its own copy


# --- the table ------------------------------------------------------------------------------

def build_columns(reps: int) -> dict[str, Callable[[Case], float]]:
    columns: dict[str, Callable[[Case], float]] = {}
    if nixl_available():
        columns["nixl"] = measure_transport("nixl", reps)
        columns["raw nixl"] = measure_raw_nixl(reps)
    columns["tcp"] = measure_transport("tcp", reps)
    columns["raw socket"] = measure_raw_socket(reps)
    columns["memcpy"] = measure_memcpy(reps)
    return columns


RATIOS = {"nixl/raw": ("nixl", "raw nixl", 0.8), "tcp/raw": ("tcp", "raw socket", 0.7)}


def run(tokens: list[int], block_sizes: list[int], reps: int) -> list[dict[str, float | int]]:
    columns = build_columns(reps)
    rows: list[dict[str, float | int]] = []
    for block_size in block_sizes:
        pool_blocks = 2 * -(-max(tokens) // block_size)
        p_kv, d_kv = make_pools(block_size, pool_blocks)
        for num_tokens in tokens:
            case = make_case(num_tokens, block_size, p_kv, d_kv)
            row: dict[str, float | int] = {"block_size": block_size, "tokens": num_tokens,
                                           "MB": case.num_bytes / 1e6}
            for column, measure in columns.items():
                row[column] = case.num_bytes / measure(case) / 1e9
            for ratio, (num, den, _) in RATIOS.items():
                if num in row and den in row:
                    row[ratio] = row[num] / row[den]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--reps", type=int, default=5, help="timed transfers per cell (the best is kept)")
    args = parser.parse_args()
    print("throughput in GB/s (SmolLM2 layout: 30 layers x 3 KV heads x 64 dims, fp32)")
    rows = run(args.tokens, args.block_sizes, args.reps)
    summarize(rows)


if __name__ == "__main__":
    main()

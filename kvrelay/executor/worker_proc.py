"""The main loop of one worker process (executor `mp`).

Start-up: take this rank's share of the CPU threads, load the weights (memory-mapped from the
model path, or the tensors the engine handed over for an in-memory model), join the process
group, build the Worker, measure the KV blocks it can hold and answer `ready` with them; then
allocate the cache the engine settles on (`INIT_KV_CACHE`) and answer `kv_ready`. Then, until
`SHUTDOWN` or the engine's end of the pipe closes: read one encoded SchedulerOutput, run it,
answer with the encoded ModelRunnerOutput (rank 0: everything; other ranks: only their
connector results). An exception is answered once with `error` and ends the process with a
non-zero code.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import NoReturn

import torch

from kvrelay.executor.serial import (
    SHUTDOWN,
    WorkerReply,
    decode_init_kv_cache,
    decode_scheduler_output,
    encode_reply,
    encode_runner_output,
)
from kvrelay.outputs import ModelRunnerOutput
from kvrelay.worker.worker import Worker, WorkerPlan

logger = logging.getLogger(__name__)


@dataclass
class WorkerProcessArgs:
    plan: WorkerPlan
    rank: int
    init_method: str  # where the ranks meet: tcp://127.0.0.1:PORT
    num_threads: int
    weights: Mapping[str, torch.Tensor] | None  # None: load from model_source
    model_source: str | None  # a GGUF file or model directory (None: the default model)


def run_worker_process(args: WorkerProcessArgs, conn: Connection) -> None:
    """Process entry point. Exits 0 after a clean shutdown, 1 after an error."""
    _die_with_engine()
    _name_process(args.plan.config.parallel.data_parallel_rank, args.rank)
    try:
        worker = _start_worker(args)
        ready = WorkerReply(kind="ready", rank=args.rank, num_blocks=worker.determine_num_blocks())
    except BaseException:  # noqa: BLE001 - every start-up failure must reach the engine
        _fail(conn, args.rank)
    _reply(conn, ready)
    try:
        message = conn.recv_bytes()
        if message != SHUTDOWN:  # SHUTDOWN here: the engine gave up before the cache existed
            init = decode_init_kv_cache(message)
            worker.initialize_kv_cache(init.num_blocks, init.max_model_len)
    except BaseException:  # noqa: BLE001 - likewise
        _fail(conn, args.rank)
    code = 0
    if message != SHUTDOWN:
        _reply(conn, WorkerReply(kind="kv_ready", rank=args.rank))
        code = _serve_steps(worker, args.rank, conn)
    worker.shutdown()
    sys.exit(code)


def _fail(conn: Connection, rank: int) -> NoReturn:
    _reply(conn, WorkerReply(kind="error", rank=rank, error=traceback.format_exc()))
    sys.exit(1)


def _die_with_engine() -> None:
    """On Linux, get SIGKILL when the engine's process dies, however it dies: a worker busy in a
    step (or blocked in a collective) would otherwise notice only at its next pipe read.
    NOTE: Linux ties this to the thread that started the worker: build the engine in a thread
    that lives as long as the engine (the main thread everywhere in kvrelay)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1  # linux/prctl.h
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):  # no prctl: the pipe still ends the loop
        return
    if os.getppid() == 1:  # the engine died before the request took effect
        os._exit(1)


def _name_process(dp_rank: int | None, tp_rank: int) -> None:
    """Name the process after its ranks (`kvrelay-dp1tp0`, what `ps -o comm` and top show), so
    an operator can tell the worker of one data-parallel rank from another's."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_name = 15  # linux/prctl.h; the kernel keeps the first 15 bytes
    name = f"kvrelay-{'' if dp_rank is None else f'dp{dp_rank}'}tp{tp_rank}"
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_name, name.encode()[:15])
    except (OSError, AttributeError):
        return


def _start_worker(args: WorkerProcessArgs) -> Worker:
    from kvrelay.distributed.parallel_state import init_tensor_parallel, rank_device
    torch.set_num_threads(args.num_threads)
    config = args.plan.config
    weights = args.weights
    if weights is None:
        from kvrelay.model.loader import load_model
        from kvrelay.worker.model_runner import torch_dtype
        weights = load_model(args.model_source, dtype=torch_dtype(config.model.dtype)).weights
    device = rank_device(config.model.device, args.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NOTE: before NCCL: each rank's communicator on its own GPU
    tp = init_tensor_parallel(args.rank, config.parallel.tensor_parallel_size, args.init_method, device)
    return Worker(args.plan, weights, tp)


def _serve_steps(worker: Worker, rank: int, conn: Connection) -> int:
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the engine is gone: nobody to serve
            logger.error("worker %d (pid %d): the engine closed the pipe; exiting", rank, os.getpid())
            return 1
        if message == SHUTDOWN:
            return 0
        try:
            output = worker.execute(decode_scheduler_output(message))
            if rank != 0:  # only rank 0 samples; the others report their connector results
                output = ModelRunnerOutput.empty(output.kv_connector_output)
            reply = WorkerReply(kind="output", rank=rank, output=encode_runner_output(output))
        except Exception:  # noqa: BLE001 - reported to the engine, which fails the instance
            _reply(conn, WorkerReply(kind="error", rank=rank, error=traceback.format_exc()))
            return 1
        if not _reply(conn, reply):
            return 1


def _reply(conn: Connection, reply: WorkerReply) -> bool:
    try:
        conn.send_bytes(encode_reply(reply))
        return True
    except (BrokenPipeError, OSError):
        return False

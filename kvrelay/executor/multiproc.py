"""`mp`: one worker process per tensor-parallel rank, spawned and supervised by the engine.

Every step the encoded SchedulerOutput goes down one pipe per rank; every rank answers on its
pipe. The executor waits on the pipes and on the processes' sentinels together, so a worker that
dies is noticed at once and one that hangs after `worker_step_timeout_s`. Either way, or when a
worker reports an exception, every worker is stopped and the executor raises WorkerFailedError
from then on: the instance is dead, loudly, and leaves no process behind.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as torch_mp

from kvrelay.core.sched_output import SchedulerOutput
from kvrelay.executor.base import Executor, WorkerFailedError
from kvrelay.executor.serial import (
    SHUTDOWN,
    WorkerReply,
    decode_reply,
    decode_runner_output,
    encode_init_kv_cache,
    encode_scheduler_output,
)
from kvrelay.executor.worker_proc import WorkerProcessArgs, run_worker_process
from kvrelay.kv_transfer.aggregator import KVOutputAggregator
from kvrelay.outputs import ModelRunnerOutput
from kvrelay.worker.worker import WorkerPlan

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # loading and sharding a model on a busy CPU
SHUTDOWN_GRACE_S = 10.0


class MultiprocExecutor(Executor):
    def __init__(self, plan: WorkerPlan, weights: Mapping[str, torch.Tensor] | None,
                 model_source: str | None = None) -> None:
        """`weights`: the whole model's tensors for an in-memory model (shared with the workers
        through shared memory); None: each worker loads `model_source` itself (memory-mapped)."""
        parallel = plan.config.parallel
        self.world_size = parallel.tensor_parallel_size
        self.step_timeout_s = float(parallel.worker_step_timeout_s)
        self.aggregator = KVOutputAggregator(self.world_size)
        self._failure: str | None = None
        self._closed = False
        context = torch_mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        num_threads = max(1, torch.get_num_threads() // self.world_size)
        self.processes: list[Any] = []
        self.conns: list[Connection] = []
        for rank in range(self.world_size):
            parent_end, child_end = context.Pipe()
            args = WorkerProcessArgs(plan=plan, rank=rank, init_method=init_method,
                                     num_threads=num_threads, weights=weights,
                                     model_source=model_source)
            process = context.Process(target=run_worker_process, args=(args, child_end),
                                      name=f"kvrelay-worker-{rank}", daemon=True)
            process.start()
            child_end.close()
            self.processes.append(process)
            self.conns.append(parent_end)
        replies = self._collect(STARTUP_TIMEOUT_S, "start-up")
        self._num_blocks = min(reply.num_blocks for reply in replies)
        logger.info("started %d worker processes (pids %s), %d threads each", self.world_size,
                    [p.pid for p in self.processes], num_threads)

    def determine_num_blocks(self) -> int:
        return self._num_blocks

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        message = encode_init_kv_cache(num_blocks, max_model_len)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(message)
            except OSError as exc:
                self._fail(f"worker {rank} cannot be reached: {exc}")
        self._collect(STARTUP_TIMEOUT_S, "the KV cache's allocation")

    # ----------------------------------------------------------------------------- step
    def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        self.check_health()
        message = encode_scheduler_output(sched_out)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(message)
            except OSError as exc:
                self._fail(f"worker {rank} cannot be reached: {exc}")
        replies = self._collect(self.step_timeout_s, "the step")
        outputs = [decode_runner_output(reply.output) for reply in replies]
        result = outputs[0]
        kv_outputs = [output.kv_connector_output for output in outputs]
        if any(kv is not None for kv in kv_outputs):
            result.kv_connector_output = self.aggregator.aggregate(kv_outputs)
        return result

    def _collect(self, timeout_s: float, what: str) -> list[WorkerReply]:
        """One reply from every rank, in rank order, or WorkerFailedError."""
        replies: list[WorkerReply | None] = [None] * self.world_size
        pending = dict(enumerate(self.conns))
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail(f"worker(s) {sorted(pending)} did not finish {what} within {timeout_s:g} s")
            waitables: list[Any] = list(pending.values())
            waitables += [self.processes[rank].sentinel for rank in pending]
            ready = wait(waitables, remaining)
            for rank, conn in list(pending.items()):
                if conn in ready or conn.poll():
                    replies[rank] = self._receive(rank, conn)
                    del pending[rank]
                elif self.processes[rank].sentinel in ready:
                    self.processes[rank].join(timeout=1.0)
                    self._fail(f"worker {rank} (pid {self.processes[rank].pid}) died during {what} "
                               f"with exit code {self.processes[rank].exitcode}")
        return [reply for reply in replies if reply is not None]

    def _receive(self, rank: int, conn: Connection) -> WorkerReply:
        try:
            reply = decode_reply(conn.recv_bytes())
        except (EOFError, OSError):
            self.processes[rank].join(timeout=1.0)
            self._fail(f"worker {rank} (pid {self.processes[rank].pid}) died: its pipe closed "
                       f"(exit code {self.processes[rank].exitcode})")
        if reply.kind == "error":
            dead = self._first_dead(exclude=rank, wait_s=1.0)
            if dead is not None:  # NOTE: a peer's death breaks this rank's collectives: name the cause
                self._fail(f"{dead}; worker {rank} then failed:\n{reply.error}")
            self._fail(f"worker {rank} failed:\n{reply.error}")
        return reply

    def _first_dead(self, exclude: int, wait_s: float) -> str | None:
        """Which other worker died (waiting up to `wait_s` for one to), described; else None."""
        others: dict[Any, int] = {
            self.processes[r].sentinel: r for r in range(self.world_size) if r != exclude}
        ready = wait(list(others), wait_s) if others else []
        for sentinel in ready:
            rank = others[sentinel]
            process = self.processes[rank]
            process.join(timeout=1.0)
            return f"worker {rank} (pid {process.pid}) died with exit code {process.exitcode}"
        return None

    # ----------------------------------------------------------------------------- health
    def check_health(self) -> None:
        if self._failure is not None:
            raise WorkerFailedError(self._failure)
        if self._closed:
            raise WorkerFailedError("the executor was shut down")
        for rank, process in enumerate(self.processes):
            if not process.is_alive():
                self._fail(f"worker {rank} (pid {process.pid}) exited with code {process.exitcode}")

    def _fail(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason
            logger.error("worker failure, stopping all %d workers: %s", self.world_size, reason)
            self._stop_processes(grace_s=0.0)
        raise WorkerFailedError(self._failure)

    # ----------------------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._failure is None:
            for conn in self.conns:
                try:
                    conn.send_bytes(SHUTDOWN)
                except OSError:
                    pass
        self._stop_processes(grace_s=SHUTDOWN_GRACE_S)

    def _stop_processes(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(timeout=2.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=2.0)
        for conn in self.conns:
            conn.close()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])

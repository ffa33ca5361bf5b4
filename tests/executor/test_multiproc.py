"""The `mp` executor's supervision: a worker that dies, hangs or raises fails the instance at once
(WorkerFailedError, every worker process stopped), and shutdown stops every worker cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvrelay.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.executor import WorkerFailedError
from kvrelay.executor.multiproc import MultiprocExecutor
from kvrelay.sampling_params import SamplingParams
from tests.tiny import tiny_loaded_model

PARAMS = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)


def make_engine(tp: int, step_timeout_s: float = 60.0) -> LLMEngine:
    config = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks_override=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
        parallel=ParallelConfig(tensor_parallel_size=tp, distributed_executor_backend="mp",
                                worker_step_timeout_s=step_timeout_s))
    return LLMEngine(config, loaded=tiny_loaded_model("llama"))


def executor_of(engine: LLMEngine) -> MultiprocExecutor:
    assert isinstance(engine.executor, MultiprocExecutor)
    return engine.executor


def assert_all_workers_gone(executor: MultiprocExecutor) -> None:
    for process in executor.processes:
        assert not process.is_alive()
        with pytest.raises(ProcessLookupError):  # reaped, not a zombie or an orphan
            os.kill(process.pid, 0)


def step_until_failure(engine: LLMEngine, max_steps: int = 100) -> WorkerFailedError:
    for _ in range(max_steps):
        try:
            engine.step()
        except WorkerFailedError as error:
            return error
    raise AssertionError(f"{max_steps} steps ran without the worker failure surfacing")


def test_killed_worker_fails_the_instance_and_stops_every_worker() -> None:
    engine = make_engine(tp=2)
    executor = executor_of(engine)
    engine.add_request({"prompt_token_ids": list(range(1, 20))}, PARAMS, request_id="a")
    engine.step()
    os.kill(executor.processes[1].pid, signal.SIGKILL)
    error = step_until_failure(engine)
    assert "worker 1" in str(error) and ("died" in str(error) or "exited" in str(error))
    assert_all_workers_gone(executor)
    with pytest.raises(WorkerFailedError):  # dead for good, not half alive
        engine.step()
    engine.shutdown()


def test_hung_worker_fails_the_step_after_the_timeout() -> None:
    engine = make_engine(tp=1, step_timeout_s=2.0)
    executor = executor_of(engine)
    engine.add_request({"prompt_token_ids": list(range(1, 20))}, PARAMS, request_id="a")
    engine.step()
    os.kill(executor.processes[0].pid, signal.SIGSTOP)  # alive, but answers nothing
    started = time.monotonic()
    with pytest.raises(WorkerFailedError, match=r"worker\(s\) \[0\] did not finish the step within 2 s"):
        engine.step()
    assert time.monotonic() - started < 60  # bounded: the timeout, not forever
    assert_all_workers_gone(executor)
    engine.shutdown()


def test_worker_exception_is_reported_with_its_traceback() -> None:
    engine = make_engine(tp=1)
    executor = executor_of(engine)
    executor.conns[0].send_bytes(b"\xc1 not a scheduler output")  # what a corrupted message does
    with pytest.raises(WorkerFailedError, match=r"worker 0 failed:\n.*Traceback"):
        executor._collect(30.0, "the step")
    assert_all_workers_gone(executor)
    engine.shutdown()


def test_shutdown_stops_every_worker_with_exit_code_zero() -> None:
    engine = make_engine(tp=2)
    executor = executor_of(engine)
    engine.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3), request_id="a")
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()
    assert [p.exitcode for p in executor.processes] == [0, 0]
    assert_all_workers_gone(executor)
    engine.shutdown()  # idempotent


_ENGINE_THEN_SLEEP = """
import time
from kvrelay import LLM
from tests.tiny import tiny_loaded_model
if __name__ == "__main__":
    llm = LLM(loaded_model=tiny_loaded_model("llama"), num_blocks=32, block_size=4, tensor_parallel_size=2)
    print(" ".join(str(pid) for pid in llm.engine.executor.pids), flush=True)
    time.sleep(600)
"""


def test_workers_die_with_a_killed_engine_process(tmp_path: Path) -> None:
    script = tmp_path / "engine.py"
    script.write_text(_ENGINE_THEN_SLEEP)
    root = Path(__file__).resolve().parents[2]
    engine = subprocess.Popen([sys.executable, str(script)], cwd=root, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(root)})
    try:
        assert engine.stdout is not None
        pids = [int(pid) for pid in engine.stdout.readline().split()]
        assert len(pids) == 2
        engine.kill()  # SIGKILL: no atexit, no shutdown
        engine.wait(timeout=30)
        deadline = time.monotonic() + 60
        while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in pids if _running(pid)], "a worker outlived its engine"
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait(timeout=30)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"

"""The engine's view of its workers: send one step to every rank, get one merged result back."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvrelay.core.sched_output import SchedulerOutput
from kvrelay.outputs import ModelRunnerOutput


class WorkerFailedError(RuntimeError):
    """A worker died, hung past the step timeout or raised: the instance cannot go on."""


class Executor(ABC):
    world_size: int

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """The KV blocks every rank can hold: the smallest of what each measured at start-up."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Have every rank allocate `num_blocks` blocks (and capture its decode graphs), before
        the first step."""

    @abstractmethod
    def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank. Returns rank 0's sampled tokens with the connector results
        of every rank merged (a transfer is finished or failed only once every rank reported it).
        Raises WorkerFailedError if any rank cannot answer; the executor is dead after that."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise WorkerFailedError if a worker is known to be gone. Cheap: no message is sent."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker (and its connector). Idempotent."""

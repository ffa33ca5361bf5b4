"""`uni`: the single worker runs inside the engine's process (the default at TP 1)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvrelay.core.sched_output import SchedulerOutput
from kvrelay.executor.base import Executor
from kvrelay.outputs import ModelRunnerOutput
from kvrelay.worker.worker import Worker, WorkerPlan


class UniProcExecutor(Executor):
    def __init__(self, plan: WorkerPlan, weights: Mapping[str, torch.Tensor]) -> None:
        if plan.config.parallel.tensor_parallel_size != 1:
            raise ValueError("distributed_executor_backend='uni' runs one worker: it needs "
                             f"tensor_parallel_size=1, got {plan.config.parallel.tensor_parallel_size}; "
                             "use 'mp'")
        self.world_size = 1
        self.worker = Worker(plan, weights)

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.worker.initialize_kv_cache(num_blocks, max_model_len)

    def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(sched_out)

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        self.worker.shutdown()

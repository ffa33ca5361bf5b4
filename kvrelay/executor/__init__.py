"""The engine's view of its workers: `uni` (in-process) and `mp` (one process per rank)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvrelay.executor.base import Executor, WorkerFailedError
from kvrelay.worker.worker import WorkerPlan


def create_executor(plan: WorkerPlan, weights: Mapping[str, torch.Tensor] | None,
                    model_source: str | None = None) -> Executor:
    """The executor `plan.config.parallel.distributed_executor_backend` names. `weights`: the whole
    model's tensors; `mp` workers load `model_source` themselves when it is None."""
    backend = plan.config.parallel.distributed_executor_backend
    if backend == "uni":
        from kvrelay.executor.uniproc import UniProcExecutor
        if weights is None:
            raise ValueError("the 'uni' executor needs the loaded weights")
        return UniProcExecutor(plan, weights)
    from kvrelay.executor.multiproc import MultiprocExecutor
    return MultiprocExecutor(plan, weights, model_source)


__all__ = ["Executor", "WorkerFailedError", "create_executor"]

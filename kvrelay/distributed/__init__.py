"""Parallel state (tensor-parallel rank and size) and the collectives the model needs."""

from kvrelay.distributed.parallel_state import (
    TensorParallelGroup,
    backend_for,
    destroy_tensor_parallel,
    init_tensor_parallel,
)

__all__ = ["TensorParallelGroup", "backend_for", "destroy_tensor_parallel", "init_tensor_parallel"]

"""The worker-side connector around one step, as one context manager, and its null object.

    with kv_connector_step(connector, sched_out) as step:
        ... forward pass (start_load_kv, layer hooks, wait_for_save), sampling ...
    step.output  # the connector's KVConnectorOutput for this step (None for the null connector)

Every step runs the same calls whether a connector is configured or not: without one the
runner holds `NULL_WORKER_CONNECTOR`, whose calls do nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvrelay.outputs import KVConnectorOutput

if TYPE_CHECKING:
    import torch

    from kvrelay.core.sched_output import SchedulerOutput
    from kvrelay.worker.forward_context import ForwardContext


class WorkerConnector(Protocol):
    """What the model runner calls on the worker-side connector (see kvrelay.kv_transfer.base)."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None: ...

    def bind_connector_metadata(self, metadata: Any) -> None: ...

    def clear_connector_metadata(self) -> None: ...

    def start_load_kv(self, forward_context: ForwardContext) -> None: ...

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None: ...

    def wait_for_save(self) -> None: ...

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput | None: ...

    def shutdown(self) -> None: ...


class NullWorkerConnector:
    """The worker-side connector of an instance without KV transfer: every call does nothing."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        return None

    def bind_connector_metadata(self, metadata: Any) -> None:
        return None

    def clear_connector_metadata(self) -> None:
        return None

    def start_load_kv(self, forward_context: ForwardContext) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput | None:
        return None

    def shutdown(self) -> None:
        return None


NULL_WORKER_CONNECTOR = NullWorkerConnector()


@dataclass
class ConnectorStep:
    output: KVConnectorOutput | None = None


@contextmanager
def kv_connector_step(connector: WorkerConnector, sched_out: SchedulerOutput) -> Iterator[ConnectorStep]:
    """bind metadata -> (the body: loads, forward, saves, sampling) -> get_finished -> clear.
    The metadata is cleared even when the body raises; get_finished runs only after a clean body."""
    step = ConnectorStep()
    connector.bind_connector_metadata(sched_out.kv_connector_metadata)
    try:
        yield step
        step.output = connector.get_finished(sched_out.finished_req_ids)
    finally:
        connector.clear_connector_metadata()

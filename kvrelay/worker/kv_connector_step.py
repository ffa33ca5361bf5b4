"""The worker-side connector around one step, as one context manager.

    with kv_connector_step(connector, sched_out) as step:
        ... forward pass (start_load_kv, layer hooks, wait_for_save), sampling ...
    step.output  # the connector's KVConnectorOutput for this step (None for the null connector)

Every step runs the same calls whether a connector is configured or not: without one the
runner holds `NULL_WORKER_CONNECTOR` (kvrelay/kv_transfer/protocols.py), whose calls do nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvrelay.outputs import KVConnectorOutput

if TYPE_CHECKING:
    from kvrelay.core.sched_output import SchedulerOutput
    from kvrelay.kv_transfer.protocols import WorkerConnector



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

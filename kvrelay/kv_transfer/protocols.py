"""Typed views of the two halves of a KV connector, as the engine and the runner use them.

KVConnectorBase implements both; the engine holds the scheduler half, each worker the worker
half (kvrelay.worker.kv_connector_step.WorkerConnector, with its null object).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvrelay.core.sched_output import SchedulerOutput
    from kvrelay.kv_transfer.base import KVConnectorMetadata
    from kvrelay.outputs import KVConnectorOutput
    from kvrelay.request import Request


class SchedulerConnector(Protocol):
    """What the scheduler and the engine call on the scheduler-side connector."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]: ...

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None: ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata | None: ...

    def update_connector_output(self, output: KVConnectorOutput) -> None: ...

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]: ...

    def has_pending_work(self) -> bool: ...

    def take_stats(self) -> dict[str, float]: ...

    def take_events(self) -> list[Any]: ...

    def shutdown(self) -> None: ...

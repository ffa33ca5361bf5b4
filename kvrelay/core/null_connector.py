"""The scheduler-side connector of an instance without KV transfer: every call does nothing.

The scheduler always has a connector, this one when none is configured, so no call site asks
whether there is one (its worker-side twin: kvrelay.worker.kv_connector_step.NullWorkerConnector).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrelay.core.sched_output import SchedulerOutput
    from kvrelay.outputs import KVConnectorOutput
    from kvrelay.request import Request


class NullSchedulerConnector:
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> None:
        return None  # the step carries no connector metadata

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        return None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def has_pending_work(self) -> bool:
        return False

    def take_stats(self) -> dict[str, float]:
        return {}

    def take_events(self) -> list[Any]:
        return []

    def shutdown(self) -> None:
        return None


NULL_SCHEDULER_CONNECTOR = NullSchedulerConnector()

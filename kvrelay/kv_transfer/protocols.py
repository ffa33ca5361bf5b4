"""The two halves of a KV connector as the engine uses them, and their null objects.

KVConnectorBase (base.py) implements both halves. The scheduler holds the scheduler half
(`SchedulerConnector`), each worker the worker half (`WorkerConnector`), and every attention
layer calls the two hooks of `LayerHooks` through the forward context. An instance without KV
transfer holds `NULL_SCHEDULER_CONNECTOR` and `NULL_WORKER_CONNECTOR`, whose calls do nothing,
so no call site ever asks whether a connector is configured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from kvrelay.core.sched_output import SchedulerOutput
    from kvrelay.kv_transfer.base import ForwardContextView, KVConnectorMetadata
    from kvrelay.outputs import KVConnectorOutput
    from kvrelay.request import Request


class SchedulerConnector(Protocol):
    """What the scheduler and the engine call on the scheduler-side connector."""

    transfer_mode: str | None  # "pull", "push" or None (KVConnectorBase says what they mean)

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

    def reset_cache(self) -> bool | None: ...

    def shutdown(self) -> None: ...


class LayerHooks(Protocol):
    """The worker-side calls an attention layer makes from inside the forward pass."""

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None: ...


class WorkerConnector(LayerHooks, Protocol):
    """What the model runner calls on the worker-side connector."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None: ...

    def bind_connector_metadata(self, metadata: Any) -> None: ...

    def clear_connector_metadata(self) -> None: ...

    def start_load_kv(self, forward_context: ForwardContextView) -> None: ...

    def uses_layer_hooks(self) -> bool: ...

    def wait_for_save(self) -> None: ...

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput | None: ...

    def shutdown(self) -> None: ...


class NullSchedulerConnector:
    """The scheduler-side connector of an instance without KV transfer: every call does nothing."""

    transfer_mode: str | None = None

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

    def reset_cache(self) -> bool | None:
        return None

    def shutdown(self) -> None:
        return None


class NullWorkerConnector:
    """The worker-side connector (and layer hooks) of an instance without KV transfer: every
    call does nothing."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        return None

    def bind_connector_metadata(self, metadata: Any) -> None:
        return None

    def clear_connector_metadata(self) -> None:
        return None

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        return None

    def uses_layer_hooks(self) -> bool:
        return False

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


NULL_SCHEDULER_CONNECTOR = NullSchedulerConnector()
NULL_WORKER_CONNECTOR = NullWorkerConnector()

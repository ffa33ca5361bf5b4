"""The per-step forward context: what attention layers need that is not a tensor argument.

The model runner sets it around each forward pass; attention layers read it. It is the only
module-level state in the worker, and it is set and reset by a context manager.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol


class WorkerLayerHooks(Protocol):
    """The worker-side connector calls made from inside the forward pass."""

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None: ...


class NoConnectorHooks:
    """Null object used when no KV connector is configured: every hook does nothing."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        return None


NO_CONNECTOR = NoConnectorHooks()


@dataclass
class ForwardContext:
    # Attention metadata by layer name (one shared object today: a single KV cache group).
    attn_metadata: dict[str, Any]
    kv_connector: WorkerLayerHooks = field(default=NO_CONNECTOR)


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("no forward context is set: call the model inside set_forward_context()")
    return _forward_context


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    global _forward_context
    previous = _forward_context
    _forward_context = context
    try:
        yield context
    finally:
        _forward_context = previous

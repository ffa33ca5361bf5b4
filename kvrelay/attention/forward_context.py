"""The per-step forward context: what attention layers need that is not a tensor argument.

The model runner sets it around each forward pass; attention layers read it. It is the only
module-level state of the forward pass, and it is set and reset by a context manager.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kvrelay.kv_transfer.protocols import NULL_WORKER_CONNECTOR, LayerHooks


@dataclass
class ForwardContext:
    # Attention metadata by layer name (one shared object today: a single KV cache group).
    attn_metadata: dict[str, Any]
    # The connector hooks each attention layer calls (the null connector's do nothing).
    kv_connector: LayerHooks = field(default=NULL_WORKER_CONNECTOR)


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

"""kvrelay: an LLM serving engine whose KV cache can leave the instance that computed it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrelay.config import EngineConfig
    from kvrelay.engine.llm import LLM
    from kvrelay.outputs import CompletionOutput, RequestOutput
    from kvrelay.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

# Imported on first use, so that `import kvrelay.core` (the scheduler side) never pulls torch in.
_LAZY = {
    "LLM": "kvrelay.engine.llm",
    "SamplingParams": "kvrelay.sampling_params",
    "EngineConfig": "kvrelay.config",
    "RequestOutput": "kvrelay.outputs",
    "CompletionOutput": "kvrelay.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvrelay' has no attribute {name!r}")

"""Frozen configuration, built once at the edge (CLI, `LLM(...)`) and never mutated."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16", "auto": "float32"}


def parse_size(value: int | str, name: str = "size") -> int:
    """'1GiB' / '512MiB' / '2e9' / 1073741824 -> bytes."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a byte count like '1GiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _SIZE_UNITS:
            raise ValueError(f"{name} must be a byte count like '1GiB' or '512MiB', got {value!r}")
        n = int(float(m.group(1)) * _SIZE_UNITS[unit])
    else:
        raise ValueError(f"{name} must be a byte count like '1GiB', got {value!r}")
    if n <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return n


def normalize_dtype(dtype: str) -> str:
    name = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower().removeprefix("torch."))
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    return name


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")
_KV_CACHE_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                           "half": "float16", "fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3"}


def normalize_kv_cache_dtype(value: str) -> str:
    """A user's spelling of kv_cache_dtype -> one of KV_CACHE_DTYPES ("auto" stays); ValueError
    naming the choices otherwise."""
    name = str(value).lower().removeprefix("torch.")
    name = _KV_CACHE_DTYPE_ALIASES.get(name, name)
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (or fp8, bf16, "
                         f"fp16), got {value!r}")
    return name


def _positive(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # None: the embedded default model (SmolLM2-135M-Instruct)
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        _positive("max_model_len", self.max_model_len, allow_none=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int = 512 * 1024**2  # bytes for all layers' KV blocks
    enable_prefix_caching: bool = True
    num_blocks_override: int | None = None  # tests: an exact block count instead of a byte budget
    # What the KV cache stores (vLLM's `--kv-cache-dtype`): "auto" (the model's dtype), float32,
    # bfloat16, float16, fp8_e4m3, fp8_e5m2; see kvrelay/model/kv_format.py.
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        object.__setattr__(self, "cache_dtype", normalize_kv_cache_dtype(self.cache_dtype))
        object.__setattr__(self, "kv_cache_memory", parse_size(self.kv_cache_memory, "kv_cache_memory"))
        _positive("num_blocks_override", self.num_blocks_override, allow_none=True)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # A waiting request's prefill is cut into chunks of at most this many tokens per step, so
    # long prompts share steps with decodes. 0 means "up to the whole budget".
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)


_EXECUTOR_BACKENDS = ("uni", "mp")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    # vLLM's names: "uni" runs the one worker in the engine's process, "mp" one process per rank.
    # None: "uni" at tensor_parallel_size 1, else "mp".
    distributed_executor_backend: str | None = None
    # A step that no worker of "mp" finishes within this many seconds fails the instance.
    worker_step_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        backend = self.distributed_executor_backend
        if backend is None:
            backend = "uni" if self.tensor_parallel_size == 1 else "mp"
        if backend not in _EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(_EXECUTOR_BACKENDS)}, "
                             f"got {backend!r}")
        if backend == "uni" and self.tensor_parallel_size != 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one worker, but "
                             f"tensor_parallel_size={self.tensor_parallel_size}: use 'mp'")
        object.__setattr__(self, "distributed_executor_backend", backend)
        if isinstance(self.worker_step_timeout_s, bool) or not isinstance(
                self.worker_step_timeout_s, int | float) or self.worker_step_timeout_s <= 0:
            raise ValueError("worker_step_timeout_s must be a positive number, "
                             f"got {self.worker_step_timeout_s!r}")

    @property
    def world_size(self) -> int:
        """Workers whose connector reports must all arrive before a transfer counts as done."""
        return self.tensor_parallel_size


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer: Any = None  # KVTransferConfig | None (kvrelay.kv_transfer.config)
    kv_events: Any = None  # KVEventsConfig | None (kvrelay.kv_events.config)

"""Frozen configuration, built once at the edge (CLI, `LLM(...)`) and never mutated."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16"}
DEFAULT_CPU_KV_CACHE_MEMORY = 512 * 1024**2  # without --kv-cache-memory on the CPU
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")


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
    """A user's spelling of the model dtype -> auto, float32, bfloat16 or float16."""
    name = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower().removeprefix("torch."))
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    return name


def resolve_device(device: str) -> str:
    """--device: "auto" is "cuda" when a GPU is visible, else "cpu"; "cpu", "cuda" and "cuda:N"
    are checked against what this machine has, with an error naming the fix."""
    name = str(device).strip().lower()
    if name == "cpu":
        return name
    if name != "auto" and not re.fullmatch(r"cuda(:\d+)?", name):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    import torch  # NOTE: only here: the scheduler side imports this module without torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "auto":
        return "cuda" if count else "cpu"
    if not count:
        raise ValueError(f"device {device!r} asks for a GPU, but torch sees none (torch "
                         f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                         "use --device cpu")
    index = int(name.partition(":")[2] or 0)
    if index >= count:
        raise ValueError(f"device {device!r}: this machine has {count} GPU(s), cuda:0..cuda:{count - 1}")
    return name


def resolve_dtype(dtype: str, device: str, checkpoint_dtype: str | None = None) -> str:
    """--dtype auto: float32 on the CPU; on a GPU the checkpoint's dtype (bfloat16 when it has
    none of its own, e.g. a quantized GGUF)."""
    name = normalize_dtype(dtype)
    if name != "auto":
        return name
    if device == "cpu":
        return "float32"
    return checkpoint_dtype if checkpoint_dtype in _DTYPES[1:] else "bfloat16"


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
    # "auto": float32 on the CPU, the checkpoint's dtype on a GPU (resolved by the engine once it
    # knows the checkpoint; on the CPU here already).
    dtype: str = "auto"
    # auto | cpu | cuda | cuda:N. An explicit device is checked here; "auto" (a GPU if one is
    # visible) is resolved by the engine or the CLI, which import torch anyway: the scheduler side
    # builds configs without importing it.
    device: str = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    served_model_name: str | None = None
    enforce_eager: bool = False  # vLLM's name: no CUDA graphs, every step runs eagerly
    # Which attention route serves the model: "auto" (cpu on the CPU, triton on CUDA), or one of
    # cpu (the native kernels), torch (plain torch, any device: the reference), triton (CUDA).
    attention_backend: str = "auto"
    # A Jinja chat template (its text) used instead of the model's own (vLLM's --chat-template).
    chat_template: str | None = None
    # The batch-invariant mode (docs/batch_invariance.md): a request's logprobs are bitwise the
    # same whatever it is batched with, however its prompt is chunked or loaded, on one instance
    # or through P/D; kvrelay/worker/batch_invariance.py.
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if str(self.device).strip().lower() != "auto":
            object.__setattr__(self, "device", resolve_device(self.device))
        dtype = normalize_dtype(self.dtype)
        if self.device == "cpu":  # a GPU's "auto" waits for the checkpoint (the engine resolves it)
            dtype = resolve_dtype(dtype, self.device)
        object.__setattr__(self, "dtype", dtype)
        _positive("max_model_len", self.max_model_len, allow_none=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.attention_backend == "cpu" and self.device not in ("cpu", "auto"):
            raise ValueError(f"attention_backend 'cpu' runs the native CPU kernels; device is {self.device}")
        _check_batch_invariant(self)
        if self.attention_backend == "triton" and self.device == "cpu" and not _triton_interpreted():
            raise ValueError("attention_backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 "
                             "to run the kernels under Triton's interpreter, for tests)")


def _check_batch_invariant(model: ModelConfig) -> None:
    """What the batch-invariant mode cannot do, known before the model loads (the rest, which
    needs the model, is checked by kvrelay/worker/batch_invariance.py)."""
    if not isinstance(model.batch_invariant, bool):
        raise ValueError(f"batch_invariant must be true or false, got {model.batch_invariant!r}")
    if not model.batch_invariant:
        return
    if model.attention_backend == "torch":
        raise ValueError("batch_invariant needs an attention route that computes prefill and decode rows "
                         "alike (cpu or triton); the torch route prefills through "
                         "scaled_dot_product_attention and decodes through batched matmuls: use "
                         "--attention-backend auto")
    if model.device == "cpu" and model.dtype != "float32":
        raise ValueError(f"batch_invariant on the CPU runs the native float32 kernels; --dtype {model.dtype} "
                         "has none: use --dtype float32 (the CPU default)")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Bytes for all layers' KV blocks. None: DEFAULT_CPU_KV_CACHE_MEMORY on the CPU; on a GPU what
    # gpu_memory_utilization leaves after the weights and a profiling forward (as vLLM does).
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9  # the share of the GPU's memory this instance may use
    enable_prefix_caching: bool = True
    num_blocks_override: int | None = None  # tests: an exact block count instead of a byte budget
    # What the KV cache stores (vLLM's `--kv-cache-dtype`): "auto" (the model's dtype), float32,
    # bfloat16, float16, fp8_e4m3, fp8_e5m2; see kvrelay/attention/kv_format.py.
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        object.__setattr__(self, "cache_dtype", normalize_kv_cache_dtype(self.cache_dtype))
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", parse_size(self.kv_cache_memory, "kv_cache_memory"))
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, int | float) \
                or not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
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
    # Data parallelism (vLLM's names): whole engines ("ranks") side by side, each with its own KV
    # cache, KV ports and engine id. data_parallel_rank: which rank this engine is; None in the
    # config of a whole group, which `kvrelay serve` turns into one config per rank
    # (EngineConfig.for_data_parallel_rank) and starts behind one endpoint.
    data_parallel_size: int = 1
    data_parallel_rank: int | None = None

    def __post_init__(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("data_parallel_size", self.data_parallel_size)
        rank = self.data_parallel_rank
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)
                                 or not 0 <= rank < self.data_parallel_size):
            raise ValueError(f"data_parallel_rank must be in [0, data_parallel_size="
                             f"{self.data_parallel_size}), got {rank!r} (pass --data-parallel-size N with "
                             "--data-parallel-rank R < N)")
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

    @property
    def data_parallel(self) -> bool:
        """Whether this engine is one rank of several (vLLM's rule: a size above 1 or a rank above
        0): its engine id, KV ports, KV events and metrics then say which rank it is."""
        return self.data_parallel_size > 1 or (self.data_parallel_rank or 0) > 0

    @property
    def is_data_parallel_group(self) -> bool:
        """The config of several ranks not yet split into one config per rank."""
        return self.data_parallel_size > 1 and self.data_parallel_rank is None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer: Any = None  # KVTransferConfig | None (kvrelay.kv_transfer.config)
    kv_events: Any = None  # KVEventsConfig | None (kvrelay.kv_events.config)

    def for_data_parallel_rank(self, dp_rank: int) -> EngineConfig:
        """The config rank `dp_rank` of this data-parallel group runs (vLLM's arithmetic): engine
        id `<id>_dp<rank>`; KV side channels from `kv_port + dp_rank * tensor_parallel_size` (TP
        rank t at + t); KV events on the endpoint's port + dp_rank (an ipc:// path gets `_dp<rank>`);
        on a GPU, its TP ranks on the GPUs after those of the ranks before it. ValueError if a
        port or GPU it needs does not exist."""
        parallel = self.parallel
        if parallel.data_parallel_rank is not None:
            raise ValueError(f"this config is already data-parallel rank {parallel.data_parallel_rank}")
        if not 0 <= dp_rank < parallel.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in [0, data_parallel_size="
                             f"{parallel.data_parallel_size}), got {dp_rank}")
        rank_parallel = dataclasses.replace(parallel, data_parallel_rank=dp_rank)
        if not rank_parallel.data_parallel:
            return dataclasses.replace(self, parallel=rank_parallel)
        tp = parallel.tensor_parallel_size
        model = self.model
        if model.device.startswith("cuda"):
            first_gpu = int(model.device.partition(":")[2] or 0) + dp_rank * tp
            model = dataclasses.replace(model, device=f"cuda:{first_gpu}")
        transfer, events = self.kv_transfer, self.kv_events
        return dataclasses.replace(
            self, model=model, parallel=rank_parallel,
            kv_transfer=None if transfer is None else transfer.for_data_parallel_rank(dp_rank, tp),
            kv_events=None if events is None else events.for_data_parallel_rank(dp_rank))


def _triton_interpreted() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"

"""The KV connector contract: how KV blocks leave and enter an engine instance.

An engine builds two instances of its connector class, one per role:

* the SCHEDULER side lives next to the scheduler. It decides what to load and save and never
  touches tensors (and never imports torch);
* the WORKER side lives next to the model runner. It moves bytes between the paged KV tensors and
  the outside world.

They share no memory. The only thing that crosses from one to the other is the per-step
`KVConnectorMetadata` (scheduler -> worker, inside the SchedulerOutput) and the per-step
`KVConnectorOutput` (worker -> scheduler, inside the ModelRunnerOutput). Both must survive
serialization, because the worker may be another process.

One engine step, with the connector calls in order::

    scheduler  get_num_new_matched_tokens(req, n_local)   admitting a waiting request
               update_state_after_alloc(req, block_ids, n_external)
               build_connector_meta(sched_output)          -> metadata, rides in sched_output
    worker     bind_connector_metadata(metadata)
               start_load_kv(forward_context)
               per attention layer:
                   wait_for_layer_load(layer_name)          before attention reads KV
                   save_kv_layer(layer_name, kv_layer, attn_metadata)   after it wrote KV
               wait_for_save()
               get_finished(finished_req_ids)              -> KVConnectorOutput, rides back
               clear_connector_metadata()
    scheduler  update_connector_output(output)
               request_finished(req, block_ids)            once per finished request

Loads come in two kinds. A synchronous load (`load_async=False`) is done inside the step that
computes the rest of the request: the blocks are filled by start_load_kv / wait_for_layer_load
before attention reads them. An asynchronous load (`load_async=True`) spans steps: the request
holds its blocks in WAITING_FOR_REMOTE_KVS until its id comes back in `finished_recving`.

KV layout (fixed): one tensor per layer, named `model.layers.{i}.self_attn.attn`, shaped
`[num_blocks, 2, num_kv_heads, block_size, head_dim]` with K at index 0 and V at index 1, so one
block's bytes are contiguous and so is one head's slice of a block.

Connector statistics travel as a flat `dict[str, float]`; numbers under the same key are summed
across workers and steps. Standard keys (a connector may add its own):
`bytes_loaded`, `bytes_saved`, `seconds_loading`, `seconds_saving`, `tokens_loaded`,
`load_failures`, `save_failures`.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import msgspec

from kvrelay.kv_transfer.config import KVTransferConfig
from kvrelay.outputs import KVConnectorOutput

if TYPE_CHECKING:
    import torch

    from kvrelay.config import EngineConfig
    from kvrelay.core.sched_output import SchedulerOutput
    from kvrelay.request import Request

LAYER_NAME_FORMAT = "model.layers.{i}.self_attn.attn"

_DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}


class ForwardContextView(Protocol):
    """What the worker side is handed by start_load_kv: the step's forward context
    (kvrelay.attention.forward_context.ForwardContext), read-only."""

    @property
    def attn_metadata(self) -> dict[str, Any]: ...


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of this engine's paged KV cache, as every connector needs to know it."""

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the KV cache format: "float32" | "bfloat16" | "float16" | "fp8_e4m3" | "fp8_e5m2"
    layer_names: Sequence[str] = ()  # stored as a tuple; empty: the standard names
    # What two instances must agree on before they exchange KV (kvrelay/kv_transfer/compat.py).
    fingerprint: dict[str, Any] = field(default_factory=dict)
    # MLA: one latent tensor per layer, [num_blocks, block_size, head_dim] (num_kv_heads 1, no K/V
    # split; head_dim is kv_lora_rank + qk_rope_head_dim). Replicated on every TP rank.
    latent: bool = False
    # Tensor parallelism: this cache is rank `tp_rank`'s shard out of `tp_size` (num_kv_heads
    # is the shard's). The scheduler side sees rank 0's spec and the same tp_size.
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_SIZES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPE_SIZES)}, got {self.dtype!r}")
        if not self.layer_names:
            names = tuple(LAYER_NAME_FORMAT.format(i=i) for i in range(self.num_layers))
            object.__setattr__(self, "layer_names", names)
        if len(self.layer_names) != self.num_layers:
            raise ValueError(f"{len(self.layer_names)} layer names for {self.num_layers} layers")
        object.__setattr__(self, "layer_names", tuple(self.layer_names))

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block of one layer: [2, num_kv_heads, block_size, head_dim], or with a latent
        cache (MLA) [block_size, head_dim]."""
        if self.latent:
            return (self.block_size, self.head_dim)
        return (2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one layer."""
        return math.prod(self.block_shape) * _DTYPE_SIZES[self.dtype]

    def fingerprint_digest(self) -> str:
        """A stable hex digest of everything that makes KV bytes interchangeable."""
        identity = {"model": self.fingerprint, "block_size": self.block_size,
                    "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                    "dtype": self.dtype, "layer_names": list(self.layer_names)}
        blob = json.dumps(identity, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()


class KVConnectorMetadata(msgspec.Struct, kw_only=True):
    """Base of every connector's per-step metadata (scheduler side -> worker side).

    Subclass it with msgspec-serializable fields. Every subclass is registered by its qualified
    name, so `KVConnectorMetadata.from_bytes` rebuilds the right class in the worker process.
    """

    _subclasses: ClassVar[dict[str, type[KVConnectorMetadata]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        KVConnectorMetadata._subclasses[_qualified_name(cls)] = cls

    def to_bytes(self) -> bytes:
        return msgspec.msgpack.encode((_qualified_name(type(self)), msgspec.msgpack.encode(self)))

    @classmethod
    def from_bytes(cls, data: bytes) -> KVConnectorMetadata:
        name, body = msgspec.msgpack.decode(data, type=tuple[str, bytes])
        target = KVConnectorMetadata._subclasses.get(name)
        if target is None or not issubclass(target, cls):
            raise ValueError(f"cannot decode connector metadata of type {name!r} as {cls.__name__}: "
                             "is its connector module imported in this process?")
        return msgspec.msgpack.decode(body, type=target)


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


KVConnectorMetadata._subclasses[_qualified_name(KVConnectorMetadata)] = KVConnectorMetadata


def add_stats(into: dict[str, float], more: Mapping[str, Any]) -> dict[str, float]:
    """Sum `more` into `into` key by key (non-numbers are ignored); returns `into`."""
    for key, value in more.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            into[key] = into.get(key, 0) + value
    return into


class KVConnectorBase(ABC):
    """Base class of every KV connector. See the module docstring for the call order.

    Constructed by the factory as `cls(config, role, kv_spec)`:
      config   the EngineConfig; `config.kv_transfer` (a KVTransferConfig, a dict or JSON) names
               this connector and carries its `kv_connector_extra_config`;
      role     which half this instance is; an instance only ever serves one role;
      kv_spec  block size, layer names, heads, head dim, dtype and model fingerprint.
    Subclasses call `super().__init__(config, role, kv_spec)` first.

    Abstract: the five methods every connector must think about. Everything else has a default
    that suits a connector which loads synchronously and never holds blocks after a request ends.
    """

    # How KV moves between a P and a D through this connector, which the proxy in front must
    # match: "pull" (D reads after P answered), "push" (P writes into D's registered blocks),
    # or None (it moves no KV between instances). `kvrelay serve` tells a proxy (GET /v1/models).
    transfer_mode: str | None = None

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_spec: KVCacheSpec) -> None:
        transfer_config = KVTransferConfig.from_any(config.kv_transfer)
        if transfer_config is None:
            raise ValueError("a KV connector needs config.kv_transfer to be set")
        self.config = config
        self.transfer_config: KVTransferConfig = transfer_config
        self.extra_config: dict[str, Any] = transfer_config.kv_connector_extra_config
        self.role = role
        self.kv_spec = kv_spec
        self.block_size = kv_spec.block_size
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._connector_metadata: KVConnectorMetadata | None = None
        self._stats: dict[str, float] = {}

    # ---------------------------------------------------------------- scheduler side

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond `num_computed_tokens` that can be loaded from outside this instance,
        and whether the load is asynchronous.

        Called when the scheduler considers admitting a waiting request; `num_computed_tokens`
        is the local prefix-cache hit (a multiple of block_size). Return `(0, False)` for
        nothing; `load_async` must be False when the count is 0. May be called several times
        for the same request (e.g. when it did not fit this step): must not change state.
        """

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """Remember what to load into which local blocks.

        Called once the scheduler allocated blocks for a request admitted with the count
        returned by get_num_new_matched_tokens (possibly 0). `block_ids` are ALL the request's
        block ids in token order; the external tokens occupy the positions right after the
        local hit, i.e. tokens [n_local, n_local + num_external_tokens).
        """

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's work for the worker side: loads to start, saves to make.

        Called at the end of every schedule(), also for steps with nothing scheduled. Resets
        the per-step state, so each load or save is handed out exactly once. Must return a
        serializable metadata object (the base class instance when there is nothing to do).
        """

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Absorb the (all-worker) results of a step: finished transfers, failures, stats.

        Called in every update_from_output, before the scheduler acts on the ids. The default
        accumulates `output.stats` for take_stats; overrides should call super().
        """
        add_stats(self._stats, output.stats)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Decide whether a finished request's blocks may be freed now.

        Called exactly once per finished request (stopped, capped, aborted or failed), before
        its blocks are freed; `block_ids` are all its blocks. Returns `(delay_free, params)`:
        with delay_free True the connector owns the blocks until the request id comes back in
        `finished_sending`; `params` (or None) become the output's `kv_transfer_params`.
        """
        return False, None

    def has_pending_work(self) -> bool:
        """True while the connector holds transfers in flight (the engine keeps stepping)."""
        return False

    def take_stats(self) -> dict[str, float]:
        """Connector statistics accumulated since the previous call (see module docstring)."""
        stats, self._stats = self._stats, {}
        return stats

    def take_events(self) -> list[Any]:
        """KV events (kvrelay.kv_events) of blocks this connector keeps outside the KV cache,
        since the previous call; called after each step while the engine publishes events.
        Default: none."""
        return []

    def reset_cache(self) -> bool | None:
        """Forget the prefixes this connector keeps outside the KV cache (vLLM's `reset_cache`,
        run by `POST /reset_prefix_cache?reset_external=true`): True done, False refused for
        now, None (the default) nothing to reset or not supported."""
        return None

    def shutdown(self) -> None:
        """Release threads, sockets and transport resources. Called once when the engine
        stops, on both halves; must be idempotent. Default: nothing to release."""
        return None

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Receive the paged KV tensors, by layer name, once after they were allocated.

        Each is `[num_blocks, 2, num_kv_heads, block_size, head_dim]`. A transport registers
        the memory here and computes block offsets. The default keeps them in `self.kv_caches`.
        """
        self.kv_caches = dict(kv_caches)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Called by the runner at the start of every step, before start_load_kv."""
        self._connector_metadata = metadata

    def clear_connector_metadata(self) -> None:
        """Called by the runner at the end of every step, after get_finished."""
        self._connector_metadata = None

    @property
    def connector_metadata(self) -> KVConnectorMetadata:
        """The metadata bound for the current step (an error outside a step)."""
        if self._connector_metadata is None:
            raise RuntimeError("no connector metadata is bound: call bind_connector_metadata first")
        return self._connector_metadata

    @abstractmethod
    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        """Start the loads in the bound metadata, before the forward pass.

        Synchronous loads may complete here; asynchronous ones may return before they finish
        (their ids come back later through get_finished). Must not block on other requests'
        compute.
        """

    def uses_layer_hooks(self) -> bool:
        """Whether this step's layer hooks (wait_for_layer_load, save_kv_layer) have work; called
        after bind_connector_metadata. A step whose hooks have none may replay a captured CUDA
        graph, which calls no hook. Default: True (a connector that never works per layer says
        False)."""
        return True

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until `layer_name`'s incoming KV for this step is in place.

        Called inside each attention layer before it reads the KV cache. Default: nothing to
        wait for (everything was loaded in start_load_kv).
        """
        return None

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """Start saving or sending `layer_name`'s KV for the requests in the bound metadata.

        Called inside each attention layer after it wrote this step's KV into `kv_layer`
        (`[num_blocks, 2, num_kv_heads, block_size, head_dim]`). May return before the save is
        done, but must not keep a reference that outlives wait_for_save.
        """

    def wait_for_save(self) -> None:
        """Block until this step's saves no longer need the KV pages (they may be reused).

        Called once after the forward pass. Default: nothing pending.
        """
        return None

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """Report what settled since the last call; called after every step.

        `finished_req_ids`: requests the scheduler finished since the last step.
        Returns a KVConnectorOutput with:
          finished_sending   requests whose blocks the connector held (delay_free) and no longer
                             needs;
          finished_recving   requests whose asynchronous load completed;
          failed_recving     requests whose asynchronous load settled unsuccessfully: nothing
                             more will be written into their blocks. An id is in at most one of
                             finished_recving / failed_recving, once per worker;
          invalid_block_ids  blocks that should have received KV but hold none valid, so the
                             scheduler recomputes from the first of them. A synchronous load
                             reports failures only this way (it has no finished/failed ids);
          stats              this worker's statistics for the step.
        Default: nothing settled, no stats.
        """
        return KVConnectorOutput()

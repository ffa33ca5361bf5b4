"""ExampleConnector (alias SharedStorageConnector): KV blocks through a shared directory.

The reference connector: short, synchronous, and complete. Copy it to start a new one.

Every new prompt's block-aligned prefix is saved once it has been computed; a later request
with the same prefix (in this process or any other that sees the directory) loads it instead
of computing it. The prefix is `align_down(len(prompt) - 1, block_size)` tokens, so at least
one prompt token is always left to compute: its logits give the first output token.

On disk, keyed by a hash of the model fingerprint and the prefix token ids:

    DIR/<key>/<layer_name>.safetensors    tensor "kv": [num_prefix_blocks, 2, H_kv, block_size, D]

Under tensor parallelism every rank stores its own shard (its KV heads) in its own entry,
`DIR/<key>.tp<size>-rank<rank>/`, and a prefix counts as stored only when every rank's entry is
there; an entry written at another TP size is never read.

A save is written into a hidden staging directory and renamed into place when every layer is
there, so a reader never sees half an entry. A missing, truncated or mismatched entry is
reported as invalid blocks (the scheduler recomputes them) and removed, never a crash.

    kv_transfer_config = {"kv_connector": "ExampleConnector",
                          "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import msgspec

from kvrelay.kv_transfer.base import (
    ForwardContextView,
    KVCacheSpec,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    add_stats,
)
from kvrelay.outputs import KVConnectorOutput

if TYPE_CHECKING:
    import torch

    from kvrelay.config import EngineConfig
    from kvrelay.core.sched_output import SchedulerOutput
    from kvrelay.request import Request

logger = logging.getLogger(__name__)


class LoadSpec(msgspec.Struct):
    req_id: str
    key: str
    block_ids: list[int]  # local blocks to fill, in token order
    first_stored_block: int  # the stored block that lands in block_ids[0]


class SaveSpec(msgspec.Struct):
    req_id: str
    key: str
    block_ids: list[int]  # the prefix's local blocks, in token order


class ExampleConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = msgspec.field(default_factory=list)
    saves: list[SaveSpec] = msgspec.field(default_factory=list)


@dataclass
class _PromptToSave:
    key: str
    num_prefix_tokens: int
    block_ids: list[int]


class ExampleConnector(KVConnectorBase):
    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_spec: KVCacheSpec) -> None:
        super().__init__(config, role, kv_spec)
        path = self.extra_config.get("shared_storage_path")
        if not isinstance(path, str) or not path:
            raise ValueError("ExampleConnector needs kv_connector_extra_config="
                             f"{{'shared_storage_path': DIR}}, got {self.extra_config!r}")
        self.storage_dir = Path(path)
        self.storage_dir.mkdir(parents=True, exist_ok=True)
        self._fingerprint = kv_spec.fingerprint_digest()
        # Scheduler side.
        self._loads: list[LoadSpec] = []
        self._unsaved: dict[str, _PromptToSave] = {}  # req_id -> prompt whose prefix is pending
        # Worker side.
        self._staging: dict[str, Path] = {}  # key -> this step's half-written entry
        self._invalid_block_ids: set[int] = set()
        self._step_stats: dict[str, float] = {}

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        num_prefix = self._num_prefix_tokens(request.prompt_token_ids)
        if num_prefix <= num_computed_tokens or num_computed_tokens % self.block_size:
            return 0, False
        if not self._is_stored(self._key(request.prompt_token_ids[:num_prefix])):
            return 0, False
        return num_prefix - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        num_prefix = self._num_prefix_tokens(request.prompt_token_ids)
        num_local = num_prefix - num_external_tokens
        if num_local < 0 or num_local % self.block_size or len(block_ids) * self.block_size < num_prefix:
            raise ValueError(f"request {request.request_id}: cannot load {num_external_tokens} tokens "
                             f"of a {num_prefix}-token stored prefix into {len(block_ids)} blocks")
        first, end = num_local // self.block_size, num_prefix // self.block_size
        key = self._key(request.prompt_token_ids[:num_prefix])
        self._loads.append(LoadSpec(request.request_id, key, block_ids[first:end], first))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = ExampleConnectorMetadata(loads=self._loads)
        self._loads = []
        for new_req in scheduler_output.scheduled_new_reqs:
            self._track_prompt(new_req.req_id, new_req.prompt_token_ids, new_req.block_ids)
        scheduled = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        for cached_req in scheduler_output.scheduled_cached_reqs:
            scheduled.append((cached_req.req_id, cached_req.num_computed_tokens))
            if (prompt := self._unsaved.get(cached_req.req_id)) is not None:
                prompt.block_ids.extend(cached_req.new_block_ids)
        saving: set[str] = set()
        for req_id, num_computed in scheduled:
            prompt = self._unsaved.get(req_id)
            num_done = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if prompt is None or num_done < prompt.num_prefix_tokens:
                continue  # chunked prefill: the prefix is not complete after this step
            del self._unsaved[req_id]
            if prompt.key in saving or self._is_stored(prompt.key):
                continue
            saving.add(prompt.key)
            num_blocks = prompt.num_prefix_tokens // self.block_size
            meta.saves.append(SaveSpec(req_id, prompt.key, prompt.block_ids[:num_blocks]))
        for req_id in scheduler_output.finished_req_ids:
            self._unsaved.pop(req_id, None)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._unsaved.pop(request.request_id, None)
        return False, None

    def _track_prompt(self, req_id: str, prompt_token_ids: list[int], block_ids: list[int]) -> None:
        num_prefix = self._num_prefix_tokens(prompt_token_ids)
        if num_prefix == 0:
            return
        key = self._key(prompt_token_ids[:num_prefix])
        if not self._is_stored(key):
            self._unsaved[req_id] = _PromptToSave(key, num_prefix, list(block_ids))

    def _num_prefix_tokens(self, prompt_token_ids: list[int]) -> int:
        return (len(prompt_token_ids) - 1) // self.block_size * self.block_size

    def _key(self, token_ids: list[int]) -> str:
        digest = hashlib.sha256(self._fingerprint.encode())
        digest.update(",".join(map(str, token_ids)).encode())
        return digest.hexdigest()[:40]

    def _is_stored(self, key: str) -> bool:
        return all(self._entry_dir(key, rank).is_dir() for rank in range(self.kv_spec.tp_size))

    def _entry_dir(self, key: str, rank: int | None = None) -> Path:
        """Where one rank's shard of an entry lives (this worker's rank by default)."""
        size = self.kv_spec.tp_size
        if size == 1:
            return self.storage_dir / key
        return self.storage_dir / f"{key}.tp{size}-rank{self.kv_spec.tp_rank if rank is None else rank}"

    # ---------------------------------------------------------------- worker side

    @property
    def _meta(self) -> ExampleConnectorMetadata:
        return cast(ExampleConnectorMetadata, self.connector_metadata)

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        for load in self._meta.loads:
            self._load(load)

    def uses_layer_hooks(self) -> bool:
        return bool(self.connector_metadata is not None and self._meta.saves)  # saves go layer by layer

    def _load(self, load: LoadSpec) -> None:
        import torch

        start = time.perf_counter()
        try:
            # NOTE: read every layer before writing any, so a bad entry leaves no partial KV.
            stored = {name: self._read_layer(load, name) for name in self.kv_spec.layer_names}
        except Exception as e:  # missing, truncated, corrupt or mismatched: recompute instead
            logger.warning("ExampleConnector: cannot load %s for request %s (%s); recomputing",
                           load.key, load.req_id, e)
            self._invalid_block_ids.update(load.block_ids)
            add_stats(self._step_stats, {"load_failures": 1})
            shutil.rmtree(self._entry_dir(load.key), ignore_errors=True)
            return
        num_bytes = 0
        for name, blocks in stored.items():
            kv_cache = self.kv_caches[name]  # [num_blocks, 2, H_kv, block_size, D]
            rows = blocks[load.first_stored_block:load.first_stored_block + len(load.block_ids)]
            kv_cache[torch.tensor(load.block_ids, device=kv_cache.device)] = rows.to(kv_cache.device)
            num_bytes += rows.numel() * rows.element_size()
        add_stats(self._step_stats, {"bytes_loaded": num_bytes,
                                     "tokens_loaded": len(load.block_ids) * self.block_size,
                                     "seconds_loading": time.perf_counter() - start})

    def _read_layer(self, load: LoadSpec, layer_name: str) -> torch.Tensor:
        from safetensors.torch import load_file

        blocks = load_file(self._entry_dir(load.key) / f"{layer_name}.safetensors")["kv"]
        expected = self.kv_caches[layer_name]
        if blocks.shape[1:] != expected.shape[1:] or blocks.dtype != expected.dtype:
            raise ValueError(f"{layer_name}: stored {tuple(blocks.shape)} {blocks.dtype}, "
                             f"cache blocks are {tuple(expected.shape[1:])} {expected.dtype}")
        if blocks.shape[0] < load.first_stored_block + len(load.block_ids):
            raise ValueError(f"{layer_name}: {blocks.shape[0]} stored blocks, need "
                             f"{load.first_stored_block + len(load.block_ids)}")
        return blocks

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        import torch
        from safetensors.torch import save_file

        for save in self._meta.saves:
            start = time.perf_counter()
            staging = self._staging.get(save.key)
            if staging is None:
                staging = self.storage_dir / f".staging-{self._entry_dir(save.key).name}-{uuid.uuid4().hex}"
                staging.mkdir()
                self._staging[save.key] = staging
            index = torch.tensor(save.block_ids, device=kv_layer.device)
            blocks = kv_layer[index].cpu().contiguous()  # [num_prefix_blocks, 2, H_kv, block_size, D]
            save_file({"kv": blocks}, staging / f"{layer_name}.safetensors")
            add_stats(self._step_stats, {"bytes_saved": blocks.numel() * blocks.element_size(),
                                         "seconds_saving": time.perf_counter() - start})

    def wait_for_save(self) -> None:
        """Publish each completed entry with one atomic rename."""
        expected = {f"{name}.safetensors" for name in self.kv_spec.layer_names}
        for key, staging in self._staging.items():
            if {p.name for p in staging.iterdir()} != expected:
                logger.warning("ExampleConnector: entry %s misses layers; not published", key)
                add_stats(self._step_stats, {"save_failures": 1})
                shutil.rmtree(staging, ignore_errors=True)
                continue
            try:
                os.rename(staging, self._entry_dir(key))
            except OSError:  # another writer published the same prefix first
                shutil.rmtree(staging, ignore_errors=True)
        self._staging.clear()

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        output = KVConnectorOutput(invalid_block_ids=self._invalid_block_ids, stats=self._step_stats)
        self._invalid_block_ids, self._step_stats = set(), {}
        return output

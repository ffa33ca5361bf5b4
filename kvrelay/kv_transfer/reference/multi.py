"""MultiConnector: several connectors behind one, e.g. a local disk cache plus a P/D transfer.

Loads come from the first child (in config order) that offers tokens for a request; saves go to
every child. A finished request's blocks stay held while any child holds them, and its id is
reported finished_sending only once every child that held it has let go.

    {"kv_connector": "MultiConnector",
     "kv_connector_extra_config": {"connectors": [
         {"kv_connector": "ExampleConnector",
          "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}},
         {"kv_connector": "NixlConnector"}]}}

Each child entry is a KVTransferConfig dict; kv_role, engine_id and kv_load_failure_policy are
inherited from the parent when absent.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
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
from kvrelay.kv_transfer.config import KVTransferConfig
from kvrelay.outputs import KVConnectorOutput

if TYPE_CHECKING:
    import torch

    from kvrelay.config import EngineConfig
    from kvrelay.core.sched_output import SchedulerOutput
    from kvrelay.request import Request

_INHERITED_KEYS = ("kv_role", "engine_id", "kv_load_failure_policy")


class MultiConnectorMetadata(KVConnectorMetadata):
    children: list[bytes] = msgspec.field(default_factory=list)  # each child's to_bytes()
    # Requests finished since the last step -> how many children hold their blocks.
    expected_sends: dict[str, int] = msgspec.field(default_factory=dict)


class MultiConnector(KVConnectorBase):
    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_spec: KVCacheSpec) -> None:
        super().__init__(config, role, kv_spec)
        from kvrelay.kv_transfer.factory import create_connector  # the factory imports us lazily

        entries = self.extra_config.get("connectors")
        if not isinstance(entries, list) or not entries:
            raise ValueError("MultiConnector needs kv_connector_extra_config={'connectors': [...]} "
                             f"with at least one child config, got {self.extra_config!r}")
        self.connectors: list[KVConnectorBase] = [
            create_connector(dataclasses.replace(config, kv_transfer=self._child_config(i, entry)),
                             role, kv_spec)
            for i, entry in enumerate(entries)
        ]
        # NOTE: the first child that moves KV between instances says how (the P/D one).
        self.transfer_mode = next((c.transfer_mode for c in self.connectors if c.transfer_mode), None)
        # Scheduler side.
        self._loading_child: dict[str, int] = {}  # req_id -> child that offered its tokens
        self._expected_sends: dict[str, int] = {}  # handed to the worker side next step
        # Worker side.
        self._send_expected: dict[str, int] = {}
        self._send_reports: Counter[str] = Counter()

    def _child_config(self, index: int, entry: Any) -> KVTransferConfig:
        if not isinstance(entry, dict):
            raise ValueError(f"MultiConnector connectors[{index}] must be a dict, got {entry!r}")
        inherited = {key: getattr(self.transfer_config, key) for key in _INHERITED_KEYS}
        try:
            child = KVTransferConfig.from_any({**inherited, **entry})
        except ValueError as e:
            raise ValueError(f"MultiConnector connectors[{index}]: {e}") from None
        assert child is not None
        return child

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        for i, child in enumerate(self.connectors):
            num_tokens, load_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if num_tokens > 0:
                # NOTE: a memo of the latest answer, overwritten on every call, so calling
                # again changes nothing; update_state_after_alloc consumes it.
                self._loading_child[request.request_id] = i
                return num_tokens, load_async
        self._loading_child.pop(request.request_id, None)
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        chosen = self._loading_child.pop(request.request_id, None)
        if num_external_tokens > 0 and chosen is None:
            raise RuntimeError(f"request {request.request_id}: {num_external_tokens} external tokens "
                               "allocated but no child offered them (get_num_new_matched_tokens?)")
        for i, child in enumerate(self.connectors):
            child.update_state_after_alloc(request, block_ids, num_external_tokens if i == chosen else 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        children = [child.build_connector_meta(scheduler_output).to_bytes() for child in self.connectors]
        meta = MultiConnectorMetadata(children=children, expected_sends=self._expected_sends)
        self._expected_sends = {}
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        super().update_connector_output(output)
        # Worker stats are counted here once; children keep only their own scheduler-side stats.
        without_stats = dataclasses.replace(output, stats={})
        for child in self.connectors:
            child.update_connector_output(without_stats)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._loading_child.pop(request.request_id, None)
        num_holders = 0
        params: dict[str, Any] = {}
        for i, child in enumerate(self.connectors):
            delay_free, child_params = child.request_finished(request, block_ids)
            num_holders += int(delay_free)
            for key, value in (child_params or {}).items():
                if key in params:
                    raise ValueError(f"request {request.request_id}: kv_transfer_params key {key!r} "
                                     f"set by two connectors (the second is connectors[{i}])")
                params[key] = value
        if num_holders:
            self._expected_sends[request.request_id] = num_holders
        return num_holders > 0, params or None

    def has_pending_work(self) -> bool:
        return any(child.has_pending_work() for child in self.connectors)

    def take_events(self) -> list[Any]:
        return [event for child in self.connectors for event in child.take_events()]

    def reset_cache(self) -> bool | None:
        results = [child.reset_cache() for child in self.connectors]
        if any(r is False for r in results):
            return False
        return True if any(r for r in results) else None

    def take_stats(self) -> dict[str, float]:
        stats = super().take_stats()
        for child in self.connectors:
            add_stats(stats, child.take_stats())
        return stats

    def shutdown(self) -> None:
        """Shut every child down, each even when an earlier one raised (the first error is
        raised once all of them had their turn)."""
        errors = []
        for child in self.connectors:
            try:
                child.shutdown()
            except Exception as e:  # noqa: BLE001 - the others must still release theirs
                errors.append(e)
        if errors:
            raise errors[0]

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        for child in self.connectors:
            child.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        meta = cast(MultiConnectorMetadata, metadata)
        for child, blob in zip(self.connectors, meta.children, strict=True):
            child.bind_connector_metadata(KVConnectorMetadata.from_bytes(blob))
        self._send_expected.update(meta.expected_sends)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for child in self.connectors:
            child.clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        for child in self.connectors:
            child.start_load_kv(forward_context)

    def uses_layer_hooks(self) -> bool:
        return any(child.uses_layer_hooks() for child in self.connectors)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for child in self.connectors:
            child.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        for child in self.connectors:
            child.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        for child in self.connectors:
            child.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        merged = KVConnectorOutput()
        for child in self.connectors:
            output = child.get_finished(finished_req_ids)
            self._send_reports.update(output.finished_sending)
            merged.finished_recving |= output.finished_recving
            merged.failed_recving |= output.failed_recving
            merged.invalid_block_ids |= output.invalid_block_ids
            add_stats(merged.stats, output.stats)
        # A child may report before this worker learned how many holders to expect: keep its
        # report until the expectation arrives with the next metadata.
        for req_id, expected in list(self._send_expected.items()):
            if self._send_reports[req_id] >= expected:
                merged.finished_sending.add(req_id)
                del self._send_expected[req_id], self._send_reports[req_id]
        return merged

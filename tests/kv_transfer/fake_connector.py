"""FakeConnector: an in-memory, scriptable KV connector for scheduler and engine tests.

Select it with `fake_transfer_config(...)` (kv_connector_module_path points here) or, once this
module is imported, by the registered name "FakeConnector". Everything is configured through
`kv_connector_extra_config` (or the setters, on an instance a test reached):

  external_tokens   [{"prompt_token_ids": [...]} or {"request_id": "r1"},
                     "available_tokens": N, "load_async": bool]
                    the first N prompt tokens of a matching request exist outside; the connector
                    offers N - num_computed_tokens of them (0 when that is not positive)
  delay_free        True, or a list of request ids: request_finished asks to hold their blocks
  kv_transfer_params            dict returned by request_finished for every request, or
  kv_transfer_params_by_request {request_id: dict}
  script            {"<step>": {"finished_sending": [...], "finished_recving": [...],
                     "failed_recving": [...], "invalid_block_ids": [...]}}: what get_finished
                    reports on worker step <step> (1 = the first call to get_finished)
  auto_finish_recving_after     k: an async load bound on step s settles on step s + k
  auto_finish_sending_after     k: a held request announced on step s is released on step s + k

Every call is appended to `self.calls` as a tuple (method name, interesting arguments...).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import msgspec

from kvrelay.kv_transfer.base import (
    KVCacheSpec,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    add_stats,
)
from kvrelay.kv_transfer.factory import register_connector
from kvrelay.outputs import KVConnectorOutput

if TYPE_CHECKING:
    from kvrelay.config import EngineConfig
    from kvrelay.core.sched_output import SchedulerOutput
    from kvrelay.request import Request


def fake_transfer_config(**extra_config: Any) -> dict[str, Any]:
    """A kv_transfer_config dict selecting FakeConnector with the given extra config."""
    return {"kv_connector": "FakeConnector", "kv_connector_module_path": __name__,
            "kv_connector_extra_config": extra_config}


_captured: list[FakeConnector] | None = None


@contextmanager
def capture_fake_connectors() -> Iterator[list[FakeConnector]]:
    """Collect every FakeConnector created inside the block (both roles), in creation order."""
    global _captured
    previous, _captured = _captured, []
    try:
        yield _captured
    finally:
        _captured = previous


class FakeLoad(msgspec.Struct):
    req_id: str
    block_ids: list[int]
    num_tokens: int
    load_async: bool


class FakeConnectorMetadata(KVConnectorMetadata):
    loads: list[FakeLoad] = msgspec.field(default_factory=list)
    held: list[str] = msgspec.field(default_factory=list)  # requests finished with delay_free


class FakeConnector(KVConnectorBase):
    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_spec: KVCacheSpec) -> None:
        super().__init__(config, role, kv_spec)
        extra = self.extra_config
        self.calls: list[tuple[Any, ...]] = []
        self.external_tokens: list[dict[str, Any]] = list(extra.get("external_tokens", []))
        self.delay_free: bool | list[str] = extra.get("delay_free", False)
        self.kv_transfer_params: dict[str, Any] | None = extra.get("kv_transfer_params")
        self.params_by_request: dict[str, dict[str, Any]] = dict(
            extra.get("kv_transfer_params_by_request", {}))
        self.script: dict[int, dict[str, Any]] = {
            int(step): dict(events) for step, events in extra.get("script", {}).items()}
        self.recv_after: int | None = extra.get("auto_finish_recving_after")
        self.send_after: int | None = extra.get("auto_finish_sending_after")
        # Scheduler side.
        self._loads: list[FakeLoad] = []
        self._held_this_step: list[str] = []
        self.loading: set[str] = set()  # async loads not yet settled
        self.holding: set[str] = set()  # finished requests whose blocks we hold
        # Worker side.
        self.steps_done = 0
        self._due_recving: dict[str, int] = {}
        self._due_sending: dict[str, int] = {}
        self.bound: list[FakeConnectorMetadata] = []
        if _captured is not None:
            _captured.append(self)

    # ---------------------------------------------------------------- test controls

    def set_external_tokens(self, available_tokens: int, load_async: bool = False, *,
                            request_id: str | None = None,
                            prompt_token_ids: list[int] | None = None) -> None:
        self.external_tokens.insert(0, {"request_id": request_id, "prompt_token_ids": prompt_token_ids,
                                        "available_tokens": available_tokens, "load_async": load_async})

    def schedule_event(self, step: int, kind: str, values: list[Any]) -> None:
        """Report `values` under `kind` (e.g. "finished_recving") on worker step `step`."""
        self.script.setdefault(step, {}).setdefault(kind, []).extend(values)

    def call_names(self) -> list[str]:
        return [call[0] for call in self.calls]

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        self.calls.append(("get_num_new_matched_tokens", request.request_id, num_computed_tokens))
        rule = self._rule_for(request)
        if rule is None:
            return 0, False
        num_tokens = max(0, int(rule["available_tokens"]) - num_computed_tokens)
        return num_tokens, bool(rule.get("load_async", False)) and num_tokens > 0

    def _rule_for(self, request: Request) -> dict[str, Any] | None:
        for rule in self.external_tokens:
            if rule.get("request_id") not in (None, request.request_id):
                continue
            prompt = rule.get("prompt_token_ids")
            if prompt is not None and list(prompt) != list(request.prompt_token_ids):
                continue
            return rule
        return None

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        self.calls.append(("update_state_after_alloc", request.request_id, list(block_ids),
                           num_external_tokens))
        if num_external_tokens == 0:
            return
        rule = self._rule_for(request)
        load_async = bool(rule and rule.get("load_async", False))
        self._loads.append(FakeLoad(request.request_id, list(block_ids), num_external_tokens, load_async))
        if load_async:
            self.loading.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self.calls.append(("build_connector_meta", scheduler_output.total_num_scheduled_tokens))
        meta = FakeConnectorMetadata(loads=self._loads, held=self._held_this_step)
        self._loads, self._held_this_step = [], []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.calls.append(("update_connector_output", sorted(output.finished_sending),
                           sorted(output.finished_recving), sorted(output.failed_recving),
                           sorted(output.invalid_block_ids)))
        super().update_connector_output(output)
        self.loading -= output.finished_recving | output.failed_recving
        self.holding -= output.finished_sending

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.calls.append(("request_finished", request.request_id, list(block_ids)))
        if isinstance(self.delay_free, bool):
            delay = self.delay_free
        else:
            delay = request.request_id in self.delay_free
        if delay:
            self.holding.add(request.request_id)
            self._held_this_step.append(request.request_id)
        params = self.params_by_request.get(request.request_id, self.kv_transfer_params)
        return delay, (dict(params) if params is not None else None)

    def has_pending_work(self) -> bool:
        return bool(self.loading or self.holding)

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.calls.append(("register_kv_caches", sorted(kv_caches)))
        super().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self.calls.append(("bind_connector_metadata",))
        super().bind_connector_metadata(metadata)
        meta = cast(FakeConnectorMetadata, metadata)
        self.bound.append(meta)
        step = self.steps_done + 1
        if self.recv_after is not None:
            for load in meta.loads:
                if load.load_async:
                    self._due_recving[load.req_id] = step + self.recv_after
        if self.send_after is not None:
            for req_id in meta.held:
                self._due_sending[req_id] = step + self.send_after

    def clear_connector_metadata(self) -> None:
        self.calls.append(("clear_connector_metadata",))
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context: Any) -> None:
        self.calls.append(("start_load_kv",))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(("wait_for_layer_load", layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        self.calls.append(("save_kv_layer", layer_name))

    def wait_for_save(self) -> None:
        self.calls.append(("wait_for_save",))

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        self.calls.append(("get_finished", sorted(finished_req_ids)))
        self.steps_done += 1
        step = self.steps_done
        events = self.script.pop(step, {})
        output = KVConnectorOutput(
            finished_sending=set(events.get("finished_sending", [])) | _take_due(self._due_sending, step),
            finished_recving=set(events.get("finished_recving", [])) | _take_due(self._due_recving, step),
            failed_recving=set(events.get("failed_recving", [])),
            invalid_block_ids=set(events.get("invalid_block_ids", [])),
        )
        add_stats(output.stats, events.get("stats", {}))
        return output


def _take_due(due: dict[str, int], step: int) -> set[str]:
    ready = {req_id for req_id, due_step in due.items() if due_step <= step}
    for req_id in ready:
        del due[req_id]
    return ready


register_connector("FakeConnector", __name__, "FakeConnector")

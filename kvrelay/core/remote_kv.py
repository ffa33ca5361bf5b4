"""Bookkeeping for KV that arrives from outside: asynchronous loads, their failures, and
requests that finished while a load into their blocks was still in flight."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from kvrelay.core.kv_cache_manager import KVCacheManager
from kvrelay.outputs import KVConnectorOutput
from kvrelay.request import Request, RequestStatus


@dataclass
class _Load:
    num_local: int  # tokens served by the local prefix cache before the load
    num_external: int  # tokens the connector is loading on top of them
    valid_cap: int | None = None  # set when some loaded blocks were reported invalid


class LoadFailure(NamedTuple):
    request: Request
    num_valid_tokens: int  # leading tokens whose KV is still trusted
    recovered: bool  # False: the `fail` policy applies and the request ends with an error


class RemoteKVTracker:
    def __init__(self, kv: KVCacheManager, block_size: int, failure_policy: str) -> None:
        self.kv = kv
        self.block_size = block_size
        self.failure_policy = failure_policy
        self._loading: dict[str, _Load] = {}  # async loads in flight, by request id
        self._settled: dict[str, int] = {}  # load settled: valid tokens, until promotion
        # Finished (aborted, errored) while a load was in flight: freed once it settles.
        # NOTE: a late write must never land in a block that was already reused.
        self._finished_while_loading: dict[str, Request] = {}

    def has_pending(self) -> bool:
        return bool(self._loading or self._finished_while_loading)

    def start_waiting(self, req: Request, num_local: int, num_external: int) -> None:
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._loading[req.request_id] = _Load(num_local, num_external)

    def try_promote(self, req: Request) -> int | None:
        """Move a request whose load settled back to WAITING with the KV it now holds.
        Returns the number of tokens that arrived from outside, or None while still loading."""
        valid = self._settled.pop(req.request_id, None)
        if valid is None:
            return None
        self.kv.cache_blocks(req, valid)  # publish only the blocks that arrived intact
        # NOTE: the last prompt token is always computed again: it yields the first logits.
        req.num_computed_tokens = min(valid, req.num_tokens - 1)
        # Count what the load saved, as a synchronous load does: the recomputed last token is
        # counted as computed, so computed + cached + external adds up to the prompt.
        num_loaded = max(0, req.num_computed_tokens - max(req.num_local_cached_tokens, 0))
        req.num_external_tokens += num_loaded
        req.status = RequestStatus.WAITING
        return num_loaded

    def defer_free_if_loading(self, req: Request) -> bool:
        """For a finished request: True (and keep it until the load settles) while a load into
        its blocks is in flight."""
        # NOTE: a settled, not yet promoted load is forgotten, or a later request reusing the
        # id would be promoted before its own load settled.
        self._settled.pop(req.request_id, None)
        if req.request_id not in self._loading:
            return False
        self._finished_while_loading[req.request_id] = req
        return True

    def on_finished_recving(self, req_id: str) -> Request | None:
        """A load settled successfully. Returns the request if it already finished meanwhile,
        so the caller frees its blocks now."""
        load = self._loading.pop(req_id, None)
        if load is None:
            return None
        finished = self._finished_while_loading.pop(req_id, None)
        if finished is not None:
            return finished
        full = load.num_local + load.num_external
        self._settled[req_id] = full if load.valid_cap is None else min(full, load.valid_cap)
        return None

    def on_failed_recving_settled(self, req_id: str) -> Request | None:
        if req_id in self._finished_while_loading:
            self._loading.pop(req_id, None)
            return self._finished_while_loading.pop(req_id)
        return None

    def apply_failures(self, kv_out: KVConnectorOutput, running: list[Request],
                       waiting: Iterable[Request]) -> list[LoadFailure]:
        """Find requests hit by failed receives or invalid blocks. Under `recompute` roll each
        back to its valid leading blocks; the caller finishes the unrecovered ones."""
        if not kv_out.failed_recving and not kv_out.invalid_block_ids:
            return []
        affected: list[LoadFailure] = []
        for req in [*running, *waiting]:
            valid = self._valid_tokens(req, kv_out)
            if valid is None:
                continue
            recover = self.failure_policy == "recompute"
            load = self._loading.get(req.request_id)
            if load is not None:
                if req.request_id in kv_out.failed_recving:  # settled, unsuccessfully
                    del self._loading[req.request_id]
                    if recover:
                        self._settled[req.request_id] = valid
                else:
                    load.valid_cap = valid if load.valid_cap is None else min(load.valid_cap, valid)
            elif recover:
                # A synchronous load: the external tokens before the first bad block stay in
                # use, so they are still counted once the recompute step succeeds.
                external_start = req.num_computed_tokens - req.num_external_unconfirmed
                req.num_computed_tokens = min(req.num_computed_tokens, valid)
                still_loaded = max(0, req.num_computed_tokens - external_start)
                req.num_external_tokens -= req.num_external_unconfirmed - still_loaded
                req.num_external_unconfirmed = still_loaded
            affected.append(LoadFailure(req, valid, recover))
        return affected

    def _valid_tokens(self, req: Request, kv_out: KVConnectorOutput) -> int | None:
        valid: int | None = None
        load = self._loading.get(req.request_id)
        if req.request_id in kv_out.failed_recving and load is not None:
            valid = load.num_local
        if kv_out.invalid_block_ids:
            block_ids = self.kv.get_block_ids(req.request_id)
            first_bad = next((i for i, b in enumerate(block_ids) if b in kv_out.invalid_block_ids), None)
            if first_bad is not None:
                bad_from = first_bad * self.block_size
                valid = bad_from if valid is None else min(valid, bad_from)
        return valid

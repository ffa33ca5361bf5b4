"""The push connector's scheduler side: which steps of P compute a push request's prompt, when P
holds its blocks, and what D registers.

Pure Python (no torch): it sees requests and block ids, never KV bytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvrelay.kv_transfer.p2p import security
from kvrelay.kv_transfer.p2p.lease_ids import make_lease_id
from kvrelay.kv_transfer.push.meta import NixlPushMetadata, PushHold, PushRecv, PushStep
from kvrelay.request import RequestStatus
from kvrelay.utils import cdiv

if TYPE_CHECKING:
    from kvrelay.core.sched_output import SchedulerOutput
    from kvrelay.kv_transfer.config import KVTransferConfig
    from kvrelay.kv_transfer.p2p.settings import NixlConfig
    from kvrelay.request import Request

TRANSFER_MODES = ("pull", "push")


def transfer_mode(params: dict[str, Any] | None) -> str:
    return str((params or {}).get("transfer_mode") or "pull")


def wants_push_prefill(request: Request) -> bool:
    """D: the request's KV is to be pushed here by a prefill instance."""
    params = request.kv_transfer_params or {}
    return bool(params.get("do_remote_prefill")) and transfer_mode(params) == "push"


def check_push_params(params: dict[str, Any], keys: security.Keys) -> str | None:
    """Why D must not register with the instance the params name, or None."""
    mode = params.get("transfer_mode")
    if mode != "push":
        return f"transfer_mode must be 'push' for a NixlPushConnector, got {mode!r}"
    if params.get("remote_block_ids") is not None:
        # NOTE: a push P names its blocks only when a pull-style prefill leg reached it; it then
        # pushes nothing, so waiting for its writes would only stall.
        return ("they are P's answer to a pull-mode prefill leg (P pushed nothing): a proxy in pull "
                "mode (the default) fronts these NixlPushConnector instances; start `kvrelay proxy` with "
                "--transfer-mode push --prefill-kv HOST:PORT")
    for name in ("remote_request_id", "remote_host"):
        if not isinstance(params.get(name), str) or not params.get(name):
            return f"the params lack {name}"
    port = params.get("remote_port")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        return f"the params' remote_port must be a port number, got {port!r}"
    if not keys.authenticated and not security.is_loopback(params["remote_host"]):
        return f"remote_host {params['remote_host']!r} is not loopback and no KV transfer secret is set"
    return None


@dataclass
class _Producing:
    """P: a push request being computed."""

    transfer_id: str
    num_prompt_tokens: int
    prompt_digest: bytes
    block_ids: list[int]


class NixlPushScheduler:
    def __init__(self, transfer_config: KVTransferConfig, nixl_config: NixlConfig,
                 keys: security.Keys, block_size: int, tp_size: int = 1) -> None:
        self.transfer_config = transfer_config
        self.tp_size = tp_size
        self.nixl_config = nixl_config
        self.keys = keys
        self.block_size = block_size
        self.host = security.advertised_host(transfer_config.kv_ip)
        self._producing: dict[str, _Producing] = {}
        self._holds: list[PushHold] = []
        self._recvs: list[PushRecv] = []
        self._aborted: list[str] = []
        self._loading: set[str] = set()  # D: registrations handed to the worker, not settled yet

    # ---------------------------------------------------------------- D: what to receive

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """The prompt beyond the local hit, arriving asynchronously. NOTE: as for a pull, bad
        params still claim the tokens so the failure policy applies to them uniformly."""
        if not self.transfer_config.is_consumer or not wants_push_prefill(request):
            return 0, False
        if request.num_prompt_tokens - 1 - num_computed_tokens <= 0:
            return 0, False
        return request.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        if self.transfer_config.is_producer and self._is_push_prefill(request):
            self._producing[request.request_id] = _Producing(
                transfer_id=str(request.kv_transfer_params["transfer_id"]),  # type: ignore[index]
                num_prompt_tokens=request.num_prompt_tokens,
                prompt_digest=security.prompt_digest(request.prompt_token_ids), block_ids=list(block_ids))
        if not self.transfer_config.is_consumer or not wants_push_prefill(request):
            return
        params = dict(request.kv_transfer_params or {})
        # NOTE: used once: a preempted request recomputes instead of registering again.
        request.kv_transfer_params = {**params, "do_remote_prefill": False}
        rejected = check_push_params(params, self.keys)
        num_prompt_blocks = cdiv(request.num_prompt_tokens, self.block_size)
        num_local = request.num_prompt_tokens - num_external_tokens
        first_block = num_local // self.block_size if num_external_tokens else num_prompt_blocks
        if num_external_tokens == 0 and rejected is not None:
            return  # a full local hit with params not worth telling anyone about
        recv = PushRecv(
            req_id=request.request_id, transfer_id=str(params.get("remote_request_id") or ""),
            remote_host=str(params.get("remote_host") or ""), remote_port=int(params.get("remote_port") or 0),
            prompt_digest=security.prompt_digest(request.prompt_token_ids),
            num_prompt_tokens=request.num_prompt_tokens, first_block=first_block,
            local_block_ids=list(block_ids[first_block:num_prompt_blocks]), rejected=rejected,
            notify_only=num_external_tokens == 0)
        self._recvs.append(recv)
        if not recv.notify_only:
            self._loading.add(request.request_id)

    def _is_push_prefill(self, request: Request) -> bool:
        params = request.kv_transfer_params or {}
        return (bool(params.get("do_remote_decode")) and transfer_mode(params) == "push"
                and isinstance(params.get("transfer_id"), str) and bool(params["transfer_id"]))

    # ---------------------------------------------------------------- P: what to push, hold

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        if req_id in self._loading:  # D: finished (aborted) while receiving
            self._aborted.append(req_id)
            return False, None
        if self.transfer_config.is_consumer and wants_push_prefill(request):
            self.update_state_after_alloc(request, [], 0)  # D: finished before admission: tell P
            return False, None
        producing = self._producing.pop(req_id, None)
        if producing is None:
            return False, self._refusing_pull_params(request, block_ids)
        complete = (request.status == RequestStatus.FINISHED_LENGTH_CAPPED
                    and request.num_computed_tokens >= request.num_prompt_tokens)
        self._holds.append(PushHold(req_id=req_id, transfer_id=producing.transfer_id, complete=complete,
                                    lease_seconds=self.nixl_config.lease_seconds))
        params = {"transfer_mode": "push", "transfer_id": producing.transfer_id,
                  "remote_engine_id": self.transfer_config.engine_id,
                  "remote_num_tokens": request.num_prompt_tokens} if complete else None
        return True, params

    def _refusing_pull_params(self, request: Request, block_ids: list[int]) -> dict[str, Any] | None:
        """A pull-style prefill leg reached this push instance: answer with signed pull params
        naming this side channel, so the pulling D hears at its handshake that the modes differ
        (and falls back per its policy). Nothing is held: this instance serves no reads."""
        params = request.kv_transfer_params
        if (not self.transfer_config.is_producer or not params or not params.get("do_remote_decode")
                or transfer_mode(params) == "push" or request.status != RequestStatus.FINISHED_LENGTH_CAPPED):
            return None
        now_ms = int(time.time() * 1000)
        out: dict[str, Any] = {
            "do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": "push",
            "remote_engine_id": self.transfer_config.engine_id, "remote_request_id": request.request_id,
            "remote_block_ids": list(block_ids[:cdiv(request.num_prompt_tokens, self.block_size)]),
            "remote_host": self.host, "remote_port": self.transfer_config.kv_port, "tp_size": self.tp_size,
            "remote_num_tokens": request.num_prompt_tokens, "remote_block_size": self.block_size,
            "remote_lease_id": make_lease_id(now_ms), "remote_lease_expiry_ms": now_ms + 1000}
        return security.signed_params(out, request.prompt_token_ids, self.keys)

    # ---------------------------------------------------------------- every step

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> NixlPushMetadata:
        steps = [self._step(req_id, data) for req_id, data in self._scheduled(scheduler_output)]
        meta = NixlPushMetadata(steps=[s for s in steps if s is not None], holds=self._holds,
                                recvs=self._recvs, aborted_recvs=self._aborted)
        self._holds, self._recvs, self._aborted = [], [], []
        return meta

    def _scheduled(self, out: SchedulerOutput) -> list[tuple[str, tuple[int, int, list[int], bool]]]:
        """(req id, (computed before, scheduled, block ids, block ids complete)) of push requests."""
        found: list[tuple[str, tuple[int, int, list[int], bool]]] = []
        for new in out.scheduled_new_reqs:
            if new.req_id in self._producing:
                found.append((new.req_id, (new.num_computed_tokens, out.num_scheduled_tokens[new.req_id],
                                           list(new.block_ids), True)))
        for cached in out.scheduled_cached_reqs:
            if cached.req_id in self._producing:
                found.append((cached.req_id, (cached.num_computed_tokens,
                                              out.num_scheduled_tokens[cached.req_id],
                                              list(cached.new_block_ids), False)))
        return found

    def _step(self, req_id: str, data: tuple[int, int, list[int], bool]) -> PushStep | None:
        computed, scheduled, block_ids, complete_list = data
        producing = self._producing[req_id]
        producing.block_ids = block_ids if complete_list else producing.block_ids + block_ids
        if computed >= producing.num_prompt_tokens:
            return None  # decoding: nothing more to push
        return PushStep(req_id=req_id, transfer_id=producing.transfer_id, block_ids=list(producing.block_ids),
                        num_computed_before=computed,
                        num_computed_after=min(computed + scheduled, producing.num_prompt_tokens),
                        num_prompt_tokens=producing.num_prompt_tokens, prompt_digest=producing.prompt_digest)

    def update_connector_output(self, output: Any) -> None:
        self._loading -= output.finished_recving
        self._loading -= output.failed_recving

    def has_pending_work(self) -> bool:
        return bool(self._holds or self._recvs or self._aborted)


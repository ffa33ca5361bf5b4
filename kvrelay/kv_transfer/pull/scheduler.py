"""The pull connector's scheduler side: issues signed params on P, decides what D pulls.

Pure Python (no torch): it sees requests and block ids, never KV bytes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvrelay.kv_transfer.p2p import security
from kvrelay.kv_transfer.p2p.lease_ids import make_lease_id
from kvrelay.kv_transfer.pull.meta import LeaseSpec, NixlConnectorMetadata, PullSpec
from kvrelay.request import RequestStatus
from kvrelay.utils import cdiv

if TYPE_CHECKING:
    from kvrelay.kv_transfer.config import KVTransferConfig
    from kvrelay.kv_transfer.p2p.settings import NixlConfig
    from kvrelay.outputs import KVConnectorOutput
    from kvrelay.request import Request


def wants_remote_prefill(request: Request) -> bool:
    params = request.kv_transfer_params
    return bool(params) and bool(params.get("do_remote_prefill"))  # type: ignore[union-attr]


def _tp_size(params: dict[str, Any]) -> int:
    """P's tensor_parallel_size from its params (absent: 1; malformed: 0, which no rank matches)."""
    value = params.get("tp_size", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 0


class NixlScheduler:
    def __init__(self, transfer_config: KVTransferConfig, nixl_config: NixlConfig,
                 keys: security.Keys, block_size: int, tp_size: int = 1) -> None:
        self.transfer_config = transfer_config
        self.tp_size = tp_size
        self.nixl_config = nixl_config
        self.keys = keys
        self.block_size = block_size
        self.host = security.advertised_host(transfer_config.kv_ip)
        self._pulls: list[PullSpec] = []
        self._leases: list[LeaseSpec] = []
        self._aborted: list[str] = []
        self._loading: set[str] = set()  # D: pulls handed to the worker, not settled yet

    # ---------------------------------------------------------------- D: what to pull

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """The prompt tokens beyond the local hit, loaded asynchronously. A prompt whose local
        hit already covers all but the last token loads nothing (only P is told, later).

        NOTE: params are checked later, in update_state_after_alloc: refused params still claim
        the tokens, so that the failure policy (recompute or fail) applies to them uniformly."""
        if not self.transfer_config.is_consumer or not wants_remote_prefill(request):
            return 0, False
        num_prompt = request.num_prompt_tokens
        if num_prompt - 1 - num_computed_tokens <= 0:
            return 0, False
        return num_prompt - num_computed_tokens, True

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        if not self.transfer_config.is_consumer or not wants_remote_prefill(request):
            return
        params = dict(request.kv_transfer_params or {})
        # NOTE: the params are used once: a preempted request recomputes instead of pulling again.
        request.kv_transfer_params = {**params, "do_remote_prefill": False}
        rejected = security.check_params(params, request.prompt_token_ids, self.block_size,
                                         self.keys.params, key_id=self.keys.key_id)
        if (rejected is None and not self.keys.authenticated
                and not security.is_loopback(params["remote_host"])):
            rejected = (f"remote_host {params['remote_host']!r} is not loopback and no KV transfer "
                        "secret is set")
        if num_external_tokens == 0:  # full local hit: nothing to read, P may free
            if rejected is None:
                self._pulls.append(self._pull_spec(request, params, [], notify_only=True))
            return
        num_local = request.num_prompt_tokens - num_external_tokens
        num_prompt_blocks = cdiv(request.num_prompt_tokens, self.block_size)
        local_block_ids = block_ids[num_local // self.block_size:num_prompt_blocks]
        pull = self._pull_spec(request, params, local_block_ids, rejected=rejected)
        self._pulls.append(pull)
        self._loading.add(request.request_id)

    def _pull_spec(self, request: Request, params: dict[str, Any], local_block_ids: list[int],
                   rejected: str | None = None, notify_only: bool = False) -> PullSpec:
        if rejected is not None:  # nothing in the params is trusted: keep none of it
            return PullSpec(req_id=request.request_id, remote_request_id="", remote_engine_id="",
                            remote_host="", remote_port=0, lease_id="", prompt_digest=b"",
                            local_block_ids=list(local_block_ids), remote_block_ids=[], rejected=rejected)
        remote_block_ids = params["remote_block_ids"]
        # NOTE: with a partial local hit D holds fewer new blocks than P offered: they pair
        # with the LAST remote blocks, which hold the same token positions.
        tail = remote_block_ids[len(remote_block_ids) - len(local_block_ids):] if local_block_ids else []
        return PullSpec(
            req_id=request.request_id, remote_request_id=params["remote_request_id"],
            remote_engine_id=params["remote_engine_id"], remote_host=params["remote_host"],
            remote_port=params["remote_port"], lease_id=params["remote_lease_id"],
            prompt_digest=security.prompt_digest(request.prompt_token_ids),
            local_block_ids=list(local_block_ids), remote_block_ids=list(tail), notify_only=notify_only,
            remote_tp_size=_tp_size(params))

    # ---------------------------------------------------------------- P: what to offer

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if request.request_id in self._loading:  # D: finished (aborted) while its pull runs
            self._aborted.append(request.request_id)
            return False, None
        if self.transfer_config.is_consumer and wants_remote_prefill(request):
            # D: finished (aborted) before it was ever admitted; P still holds the blocks.
            self.update_state_after_alloc(request, [], 0)
            return False, None
        params = request.kv_transfer_params
        if (not self.transfer_config.is_producer or not params or not params.get("do_remote_decode")
                or request.status != RequestStatus.FINISHED_LENGTH_CAPPED
                or request.num_computed_tokens < request.num_prompt_tokens):
            return False, None
        prompt_block_ids = list(block_ids[:cdiv(request.num_prompt_tokens, self.block_size)])
        now_ms = int(time.time() * 1000)
        lease_id = make_lease_id(now_ms)
        expiry_ms = now_ms + int(self.nixl_config.lease_seconds * 1000)
        out = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.transfer_config.engine_id,
            "remote_request_id": request.request_id, "remote_block_ids": prompt_block_ids,
            "remote_host": self.host, "remote_port": self.transfer_config.kv_port, "tp_size": self.tp_size,
            "remote_num_tokens": request.num_prompt_tokens, "remote_block_size": self.block_size,
            "remote_lease_id": lease_id, "remote_lease_expiry_ms": expiry_ms, "transfer_mode": "pull",
        }
        out = security.signed_params(out, request.prompt_token_ids, self.keys)
        self._leases.append(LeaseSpec(
            req_id=request.request_id, lease_id=lease_id, block_ids=prompt_block_ids,
            prompt_digest=security.prompt_digest(request.prompt_token_ids), expiry_ms=expiry_ms))
        return True, out

    # ---------------------------------------------------------------- every step

    def build_connector_meta(self) -> NixlConnectorMetadata:
        meta = NixlConnectorMetadata(pulls=self._pulls, leases=self._leases, aborted_pulls=self._aborted)
        self._pulls, self._leases, self._aborted = [], [], []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._loading -= output.finished_recving
        self._loading -= output.failed_recving

    def has_pending_work(self) -> bool:
        return bool(self._pulls or self._leases or self._aborted)

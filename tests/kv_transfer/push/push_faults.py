"""A NixlPushConnector whose rank 1 fails its writes, or misstates its checksums, for chosen
transfers: fault injection that reaches a tensor-parallel engine's worker processes (selected by
kv_connector_module_path)."""

from __future__ import annotations

from typing import Any

from kvrelay.kv_transfer.push.connector import NixlPushConnector
from kvrelay.kv_transfer.push.meta import PushNotification
from kvrelay.kv_transfer.transport.base import FinishedTransfer, TransferHandle

FAILING_MARK = "fail-rank-1"  # a transfer id containing this fails every write of rank 1
CORRUPT_MARK = "corrupt-rank-1"  # ... or has rank 1 state a wrong checksum for its first block


class RankFailingPushConnector(NixlPushConnector):
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        transport = self.worker.transport
        if self.kv_spec.tp_rank != 1 or transport is None:
            return
        write = transport.write_blocks
        sender = self.worker.sender

        def failing(remote: str, local: list[int], remote_ids: list[int], notification: bytes,
                    layers: Any = None, ranges: Any = None) -> TransferHandle:
            jobs = sender._jobs.values() if sender is not None else []
            if any(FAILING_MARK in job.transfer_id and set(remote_ids) <= set(reg.request.block_ids)
                   for job in jobs for reg in job.registrations):
                return FinishedTransfer("injected write failure on rank 1")
            note = PushNotification.decode(notification)
            if note is not None and CORRUPT_MARK in note.transfer_id and note.checksums:
                note.checksums[0] += 1
                notification = note.encode()
            return write(remote, local, remote_ids, notification, layers, ranges=ranges)

        transport.write_blocks = failing  # type: ignore[method-assign]


def failing_push_config(config: dict[str, Any]) -> dict[str, Any]:
    return {**config, "kv_connector": "RankFailingPushConnector", "kv_connector_module_path": __name__}

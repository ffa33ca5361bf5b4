"""The start-up check of a P2P connector's transfer path: a short loopback transfer on the KV
device through the configured backend (transport/loopback.py), reported three ways:

- one log line with the path and its GB/s;
- a stat the scheduler turns into the gauge `kvrelay_kv_transfer_loopback_gbps{backend,path}`;
- with KV on a GPU and a path that is not a CUDA one, a loud warning naming the cause and the
  fix, or, with `require_device_path: true`, a refusal to start (ValueError: `serve` exits 2).

`loopback_check_bytes: 0` turns the measurement off (the path is still named and enforced).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from kvrelay.kv_transfer.p2p.settings import build_transport
from kvrelay.kv_transfer.transport.loopback import LoopbackResult, data_path, measure_loopback

if TYPE_CHECKING:
    from kvrelay.kv_transfer.config import KVTransferConfig
    from kvrelay.kv_transfer.p2p.settings import NixlConfig
    from kvrelay.kv_transfer.transport.base import KVTransport

logger = logging.getLogger(__name__)

STAT_PREFIX = "loopback_gbps"  # stats key: "loopback_gbps:{backend}:{path}:{tp_rank}"


def stat_key(result: LoopbackResult, tp_rank: int) -> str:
    return f"{STAT_PREFIX}:{result.backend}:{result.path.name}:{tp_rank}"


def check_transfer_path(settings: NixlConfig, transfer_config: KVTransferConfig, secret: bytes | None,
                        device: str) -> LoopbackResult | None:
    """Measure (unless turned off), log, warn or refuse; the measurement, or None when off.

    A measurement that fails is logged as a warning and returns None: the instance still serves
    (its transfers will fail and recover by the failure policy) unless a device path is required."""
    backend = settings.backend
    staged = transfer_config.kv_buffer_device == "cpu"
    result = None
    if settings.loopback_check_bytes:
        def make(engine_id: str) -> KVTransport:
            named = dataclasses.replace(transfer_config, engine_id=engine_id)
            return build_transport(settings, named, secret)

        try:
            result = measure_loopback(backend, device, make, settings.loopback_check_bytes,
                                      settings.transfer_timeout_seconds, staged)
        except Exception as e:
            logger.warning("KV transfer path: the %s loopback check on %s failed: %s", backend, device, e)
        else:
            logger.info("KV transfer path: backend %s on %s took path %s: %.2f GB/s (loopback, %d MiB)",
                        backend, device, result.path.name, result.gbps, result.num_bytes >> 20)
    path = result.path if result is not None else data_path(backend, device, staged)
    if device != "cpu" and path.cause is not None:
        problem = (f"KV lives on {device} but backend {backend!r} takes path {path.name!r}, not a CUDA "
                   f"one: {path.cause}")
        if settings.require_device_path:
            raise ValueError(f"{problem} (require_device_path is set, so this instance refuses to start)")
        logger.warning("%s\n!!! KV transfers will run at host-copy speed or worse; set require_device_path: "
                       "true to refuse instead. See docs/connectors.md#kv-on-a-gpu", problem)
    return result


def startup_stats(settings: NixlConfig, transfer_config: KVTransferConfig, secret: bytes | None,
                  device: str, tp_rank: int) -> dict[str, float]:
    """check_transfer_path for a worker: the stat its first step reports (none without a figure)."""
    result = check_transfer_path(settings, transfer_config, secret, device)
    return {} if result is None else {stat_key(result, tp_rank): result.gbps}

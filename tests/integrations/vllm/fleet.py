"""The fleet the vLLM integration tests share (one per session: `vllm serve` takes seconds to start,
so test_offload.py and test_pd.py run on the same instances; conftest.py starts it).

    p        vllm serve, MultiConnector[KvrelayConnector kv_producer, KvrelayOffloadConnector cpu + redis]
    d        vllm serve, MultiConnector[KvrelayConnector kv_consumer, KvrelayOffloadConnector disk + redis],
             kv_load_failure_policy "recompute"
    d_fail   vllm serve, KvrelayConnector kv_consumer through its module path, policy "fail"
    kvrelay      kvrelay serve, NixlConnector kv_both (the same weights and block size)
    kvrelay_fp8  kvrelay serve, NixlConnector kv_producer with an fp8 KV cache: no vLLM D can use its blocks

The vLLM instances run without a prefix cache of their own: a repeated prompt can only come from
a connector (P/D, or kvrelay's tiers), and one prompt set serves several tests. The MultiConnector
children are named as the `vllm.general_plugins` entry point registers them (no module path). A
cluster secret is set, so params are signed for real. P is on core 0, the Ds on core 1.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.entrypoints.serve_process import ServeProcess, free_port
from tests.integrations.vllm.helpers import connector_config, kvrelay_serve, multi_config, vllm_args
from tests.kv_transfer.offload.redis_server import RedisServer
from tests.vllm_serve import VllmServer

LEASE_S = 15.0  # P's lease: refused params leave P's blocks held this long
TIMEOUT_S = 4.0  # D gives up on an unreachable P after this
RETRY_S = 1.0  # a failed Redis is skipped this long before it is asked again
OFFLOAD = "KvrelayOffloadConnector"


@dataclass
class Fleet:
    p: VllmServer
    d: VllmServer
    d_fail: VllmServer
    kvrelay: ServeProcess
    kvrelay_fp8: ServeProcess
    redis: RedisServer
    disk_dir: Path
    secret_file: Path
    log_dir: Path


@contextmanager
def started_fleet(log_dir: Path) -> Iterator[Fleet]:
    secret_file = log_dir / "kv-secret"
    secret_file.write_text(secrets.token_hex(32))
    redis, disk_dir = RedisServer(), log_dir / "disk-tier"
    pull = {"secret_file": str(secret_file), "lease_seconds": LEASE_S, "transfer_timeout_seconds": TIMEOUT_S}
    remote = {"remote_url": redis.url, "retry_seconds": RETRY_S, "remote_timeout_seconds": 5.0}
    tiers = ({"cpu_bytes": "256MiB", **remote}, {"disk_dir": str(disk_dir), "disk_bytes": "512MiB", **remote})
    p, d = (VllmServer(log_dir / f"{name}.log", *vllm_args(multi_config([
        connector_config("KvrelayConnector", role, extra=pull, module_path=False),
        connector_config(OFFLOAD, "kv_both", extra=tier, module_path=False)], "kv_both"),
        "--no-enable-prefix-caching"), core=core)
        for name, role, tier, core in (("p", "kv_producer", tiers[0], 0), ("d", "kv_consumer", tiers[1], 1)))
    d_fail = VllmServer(log_dir / "d_fail.log", *vllm_args(connector_config(
        "KvrelayConnector", "kv_consumer", policy="fail", extra=pull), "--no-enable-prefix-caching"), core=1)
    kvrelay, kvrelay_fp8 = (kvrelay_serve(log_dir / f"kvrelay-{role}.log", {
        "kv_connector": "NixlConnector", "kv_role": role, "kv_port": free_port(),
        "kv_connector_extra_config": pull}, *more) for role, more in (
            ("kv_both", ()), ("kv_producer", ("--kv-cache-dtype", "fp8_e4m3"))))
    fleet = Fleet(p, d, d_fail, kvrelay, kvrelay_fp8, redis, disk_dir, secret_file, log_dir)
    try:
        for server in (p, d, d_fail):
            server.wait_healthy()
        kvrelay.wait_healthy()
        kvrelay_fp8.wait_healthy()
        yield fleet
    finally:
        for server in (p, d, d_fail):
            server.stop()
        kvrelay.stop()
        kvrelay_fp8.stop()
        fleet.redis.stop()

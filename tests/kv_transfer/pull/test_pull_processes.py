"""NixlConnector between real P and D engine processes on loopback, over the real transports
(TCP always, NIXL and Mooncake where they are importable)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.kv_transfer.p2p.engine_proc import EngineProcess
from tests.kv_transfer.p2p.pd import (
    BLOCK_SIZE,
    PREFILL_PARAMS,
    make_engine,
    nixl_config,
    prompt,
    reference_tokens,
)

SECRET = {"KVRELAY_KV_SECRET": "process-test-secret-0123456789"}


def _backend_available(backend: str) -> bool:
    try:
        from kvrelay.kv_transfer.transport import create_transport  # noqa: F401
    except ImportError:
        return False
    from kvrelay.kv_transfer.transport import nixl_installed

    if backend == "mooncake":
        from kvrelay.kv_transfer.transport.mooncake import mooncake_available

        return mooncake_available()[0]
    return backend == "tcp" or nixl_installed()


BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(not _backend_available(b), reason=f"no {b} transport"))
            for b in ("tcp", "nixl", "mooncake")]


@pytest.fixture(scope="module")
def reference() -> Any:
    return make_engine(None)


@pytest.fixture
def processes() -> Iterator[list[EngineProcess]]:
    """Started engine processes; each must end with no block in use and no thread left."""
    started: list[EngineProcess] = []
    yield started
    for proc in started:
        if proc.process.is_alive():
            assert proc.wait_idle()["blocks_in_use"] == 0
            assert proc.stop() == []
        proc.kill()


def _prefill(p: EngineProcess, request_id: str, tokens: list[int]) -> dict[str, Any]:
    out = p.generate(request_id, tokens, 1, dict(PREFILL_PARAMS))
    assert out["kv_transfer_params"] is not None, out
    return out["kv_transfer_params"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("backend", BACKENDS)
def test_processes_reproduce_single_instance_tokens(processes, reference, backend) -> None:
    p = EngineProcess(nixl_config("kv_producer", backend=backend), SECRET)
    processes.append(p)
    d = EngineProcess(nixl_config("kv_consumer", backend=backend), SECRET)
    processes.append(d)
    prompts = {"short": prompt(BLOCK_SIZE - 1, 30), "exact": prompt(3 * BLOCK_SIZE, 31),
               "partial": prompt(3 * BLOCK_SIZE + 2, 32)}
    params = {rid: _prefill(p, f"p-{rid}", tokens) for rid, tokens in prompts.items()}
    for rid, tokens in prompts.items():  # concurrently on D
        d.add(rid, tokens, 5, params[rid])
    got = {rid: d.result(rid)["token_ids"] for rid in prompts}
    assert got == reference_tokens(reference, prompts, 5)
    # A full local prefix hit on D (its cache is warm from "exact"): only the notification.
    hit = prompt(3 * BLOCK_SIZE, 31) + [7]
    out = d.generate("hit", hit, 3, _prefill(p, "p-hit", hit))
    assert out["token_ids"] == reference_tokens(reference, {"hit": hit}, 3)["hit"]
    assert d.stats()["kv_load_failures"] == 0
    assert p.wait_idle()["kv_lease_expired"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_p_killed_mid_flight_d_recomputes(processes, reference, backend) -> None:
    p = EngineProcess(nixl_config("kv_producer", backend=backend), SECRET)
    processes.append(p)
    d = EngineProcess(nixl_config("kv_consumer", backend=backend, transfer_timeout_seconds=2.0), SECRET)
    processes.append(d)
    first = prompt(2 * BLOCK_SIZE + 1, 33)
    assert d.generate("first", first, 2, _prefill(p, "p-first", first))["finish_reason"] == "length"
    tokens = prompt(3 * BLOCK_SIZE + 1, 34)
    params = _prefill(p, "p-dead", tokens)
    p.kill()  # after the handshake, before D asks for this request's blocks
    out = d.generate("dead", tokens, 4, params)
    assert out["token_ids"] == reference_tokens(reference, {"dead": tokens}, 4)["dead"]
    assert d.stats()["kv_load_failures"] == 1


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.values == ("nixl",)])
def test_an_idle_nixl_transport_still_serves_reads_at_once(processes, reference, backend) -> None:
    """Between requests the NIXL progress thread polls slowly (IDLE_INTERVAL_S); here that is a
    minute, so a read that waited for it (P serving D's read without expecting it) would time
    out. P expects reads while it holds leases, D while its pulls run."""
    slow = {**SECRET, "KVRELAY_TEST_NIXL_IDLE_S": "60"}
    p = EngineProcess(nixl_config("kv_producer", backend=backend), slow)
    processes.append(p)
    d = EngineProcess(nixl_config("kv_consumer", backend=backend, transfer_timeout_seconds=20.0), slow)
    processes.append(d)
    for i in range(2):  # the second after both went idle again
        tokens = prompt(3 * BLOCK_SIZE + 2, 40 + i)
        out = d.generate(f"r{i}", tokens, 3, _prefill(p, f"p-r{i}", tokens))
        assert out["token_ids"] == reference_tokens(reference, {"r": tokens}, 3)["r"]
        assert d.wait_idle()["blocks_in_use"] == 0 and p.wait_idle()["blocks_in_use"] == 0
    assert d.stats()["kv_load_failures"] == 0

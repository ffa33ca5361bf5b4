"""NixlPushConnector between real P and D engine processes on loopback, over the real transports
(TCP always, NIXL where it is installed): answers equal a single instance's, whatever the
order of registration and prefill, and nothing leaks on either side."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from tests.kv_transfer.p2p.engine_proc import EngineProcess
from tests.kv_transfer.p2p.pd import (
    BLOCK_SIZE,
    free_port,
    make_engine,
    nixl_config,
    prompt,
    reference_tokens,
)
from tests.kv_transfer.pull.test_pull_processes import BACKENDS, SECRET

pytestmark = pytest.mark.timeout(300)


def push_config(role: str, backend: str, port: int | None = None, policy: str = "recompute",
                **extra: Any) -> dict[str, Any]:
    config = nixl_config(role, port=port, policy=policy, backend=backend, **extra)
    return {**config, "kv_connector": "NixlPushConnector"}


def p_params(transfer_id: str) -> dict[str, Any]:
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_mode": "push",
            "transfer_id": transfer_id}


def d_params(transfer_id: str, p_port: int) -> dict[str, Any]:
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": "push",
            "remote_request_id": transfer_id, "remote_host": "127.0.0.1", "remote_port": p_port,
            "remote_engine_id": None}


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


def start_pair(processes: list[EngineProcess], backend: str, p_batch: int = 256,
               p_extra: dict[str, Any] | None = None,
               **d_extra: Any) -> tuple[EngineProcess, EngineProcess, int]:
    port = free_port()
    p = EngineProcess(push_config("kv_producer", backend, port=port, **(p_extra or {})), SECRET,
                      engine_options={"max_num_batched_tokens": p_batch})
    processes.append(p)
    d = EngineProcess(push_config("kv_consumer", backend, **d_extra), SECRET)
    processes.append(d)
    return p, d, port


@pytest.mark.parametrize("backend", BACKENDS)
def test_push_reproduces_single_instance_tokens(processes, reference, backend) -> None:
    # P computes at most 16 tokens a step: the 41-token prompt is pushed chunk by chunk.
    p, d, port = start_pair(processes, backend, p_batch=16)
    prompts = {"short": prompt(BLOCK_SIZE - 1, 40), "exact": prompt(3 * BLOCK_SIZE, 41),
               "partial": prompt(3 * BLOCK_SIZE + 2, 42), "chunked": prompt(10 * BLOCK_SIZE + 1, 43)}
    for rid, tokens in prompts.items():  # D registers before P has even seen the requests
        d.add(rid, tokens, 5, d_params(f"t-{rid}", port))
    for rid, tokens in prompts.items():
        p.add(f"p-{rid}", tokens, 1, p_params(f"t-{rid}"))
    got = {rid: d.result(rid)["token_ids"] for rid in prompts}
    assert got == reference_tokens(reference, prompts, 5)
    for rid in prompts:
        params = p.result(f"p-{rid}")["kv_transfer_params"]
        assert params["transfer_mode"] == "push" and params["transfer_id"] == f"t-{rid}"
    stats = d.stats()
    assert stats["kv_load_failures"] == 0
    assert stats["prompt_tokens_computed"] == len(prompts)  # the minus-one rule: one token each
    assert p.wait_idle()["kv_lease_expired"] == 0


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.values == ("nixl",)])
def test_an_idle_nixl_transport_still_takes_pushes_at_once(processes, reference, backend) -> None:
    """Between requests the NIXL progress thread polls slowly (IDLE_INTERVAL_S); here that is a
    minute, so a push that waited for it would time out. D expects writes while its receives are
    due and P while it has pushes to send. (On this UCX build D's side takes writes even
    unpolled, unlike a read's serving side, test_pull_processes: this guards the push path's
    latency against the slow pace, not D's hint alone.)"""
    port = free_port()
    slow = {**SECRET, "KVRELAY_TEST_NIXL_IDLE_S": "60"}
    p = EngineProcess(push_config("kv_producer", backend, port=port), slow)
    processes.append(p)
    d = EngineProcess(push_config("kv_consumer", backend, transfer_timeout_seconds=20.0), slow)
    processes.append(d)
    for i in range(2):  # the second after both went idle again
        tokens = prompt(3 * BLOCK_SIZE + 2, 50 + i)
        d.add(f"r{i}", tokens, 3, d_params(f"t-{i}", port))
        p.add(f"p-{i}", tokens, 1, p_params(f"t-{i}"))
        assert d.result(f"r{i}")["token_ids"] == reference_tokens(reference, {"r": tokens}, 3)["r"]
        p.result(f"p-{i}")
        assert d.wait_idle()["blocks_in_use"] == 0 and p.wait_idle()["blocks_in_use"] == 0
    assert d.stats()["kv_load_failures"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_registration_after_p_finished_and_local_prefix_hits(processes, reference, backend) -> None:
    p, d, port = start_pair(processes, backend)
    base = prompt(3 * BLOCK_SIZE, 44)
    late = base + [9, 8]
    p.generate("p-late", late, 1, p_params("t-late"))  # P done before D registers
    out = d.generate("late", late, 4, d_params("t-late", port))
    assert out["token_ids"] == reference_tokens(reference, {"late": late}, 4)["late"]
    # A partial local hit on D (its cache now holds `base`'s 3 blocks): P pushes the rest only.
    partial = base + prompt(2 * BLOCK_SIZE + 1, 45)
    d.add("partial", partial, 4, d_params("t-partial", port))
    p.add("p-partial", partial, 1, p_params("t-partial"))
    assert d.result("partial")["token_ids"] == reference_tokens(reference, {"partial": partial}, 4)["partial"]
    # A full local hit: nothing to push; P still frees its blocks without waiting for the lease.
    full = base + [5]
    d.add("full", full, 3, d_params("t-full", port))
    p.add("p-full", full, 1, p_params("t-full"))
    assert d.result("full")["token_ids"] == reference_tokens(reference, {"full": full}, 3)["full"]
    assert d.stats()["kv_load_failures"] == 0
    assert p.wait_idle(timeout_s=20)["kv_lease_expired"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_p_killed_after_registration_d_recomputes(processes, reference, backend) -> None:
    p, d, port = start_pair(processes, backend, transfer_timeout_seconds=2.0, heartbeat_seconds=0.3)
    warm = prompt(2 * BLOCK_SIZE + 1, 46)
    d.add("warm", warm, 2, d_params("t-warm", port))
    p.add("p-warm", warm, 1, p_params("t-warm"))
    assert d.result("warm")["finish_reason"] == "length"
    tokens = prompt(3 * BLOCK_SIZE + 1, 47)
    d.add("dead", tokens, 4, d_params("t-dead", port))  # registered; P never sees the request
    p.kill()
    out = d.result("dead", timeout_s=60)
    assert out["token_ids"] == reference_tokens(reference, {"dead": tokens}, 4)["dead"]
    assert d.stats()["kv_load_failures"] == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_registration_for_a_request_p_never_sees_is_refused(processes, reference, backend) -> None:
    p, d, port = start_pair(processes, backend, transfer_timeout_seconds=1.5)
    tokens = prompt(2 * BLOCK_SIZE + 3, 48)
    out = d.generate("orphan", tokens, 3, d_params("t-nobody", port))
    assert out["token_ids"] == reference_tokens(reference, {"orphan": tokens}, 3)["orphan"]
    assert d.stats()["kv_load_failures"] == 1
    assert p.wait_idle()["blocks_in_use"] == 0


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_push_d_refuses_a_pull_p_at_the_handshake(processes, reference, policy) -> None:
    port = free_port()
    p = EngineProcess(nixl_config("kv_producer", port=port, backend="tcp"), SECRET)  # pull P
    processes.append(p)
    d = EngineProcess(push_config("kv_consumer", "tcp", policy=policy), SECRET)
    processes.append(d)
    tokens = prompt(2 * BLOCK_SIZE + 1, 49)
    out = d.generate("mixed", tokens, 3, d_params("t-mixed", port))
    if policy == "recompute":
        assert out["token_ids"] == reference_tokens(reference, {"mixed": tokens}, 3)["mixed"]
    else:
        assert out["finish_reason"] == "error" and out["error"]
    assert d.stats()["kv_load_failures"] == 1


def test_pull_d_refuses_a_push_p_at_the_handshake(processes, reference) -> None:
    p = EngineProcess(push_config("kv_producer", "tcp"), SECRET)
    processes.append(p)
    d = EngineProcess(nixl_config("kv_consumer", backend="tcp"), SECRET)  # pull D
    processes.append(d)
    tokens = prompt(2 * BLOCK_SIZE + 1, 50)
    params = p.generate("p-pull", tokens, 1, {"do_remote_decode": True, "do_remote_prefill": False})
    assert params["kv_transfer_params"]["transfer_mode"] == "push"
    out = d.generate("pull", tokens, 3, params["kv_transfer_params"])
    assert out["token_ids"] == reference_tokens(reference, {"pull": tokens}, 3)["pull"]
    assert d.stats()["kv_load_failures"] == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_hung_p_d_recomputes_and_the_resumed_p_writes_nothing(processes, reference, backend) -> None:
    p, d, port = start_pair(processes, backend, p_extra={"lease_seconds": 2.0},
                            transfer_timeout_seconds=1.0, heartbeat_seconds=0.2)
    warm = prompt(2 * BLOCK_SIZE + 1, 51)
    d.add("warm", warm, 2, d_params("t-warm", port))
    p.add("p-warm", warm, 1, p_params("t-warm"))
    assert d.result("warm")["finish_reason"] == "length"
    p.result("p-warm")
    # NOTE: P counts a write once it has landed, which it may see after D finished the request
    written = p.wait_idle()["kv_transfer_bytes"]
    assert written > 0
    os.kill(p.process.pid, signal.SIGSTOP)
    try:
        tokens = prompt(3 * BLOCK_SIZE + 1, 52)
        d.add("hung", tokens, 4, d_params("t-hung", port))
        p.add("p-hung", tokens, 1, p_params("t-hung"))  # waits in the pipe while P is stopped
        out = d.result("hung", timeout_s=60)
        assert out["token_ids"] == reference_tokens(reference, {"hung": tokens}, 4)["hung"]
        assert d.stats()["kv_load_failures"] == 1
    finally:
        os.kill(p.process.pid, signal.SIGCONT)
    p.result("p-hung")  # P computes it now; D's stale registration and heartbeats are refused
    assert p.wait_idle()["kv_transfer_bytes"] == written  # not one byte pushed after D gave up

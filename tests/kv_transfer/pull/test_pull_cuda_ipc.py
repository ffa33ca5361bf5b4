"""NixlConnector with `backend: "cuda_ipc"` end to end: P and D engines in one process, the real
CUDA IPC transport on its HostIpc seam (KV in shared host memory, so it runs without a GPU), the
real side channel, leases, checksums and failure policy. The make_pd fixture checks every test
ends with zero blocks in use and no thread left; here D must also have closed every handle."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay.kv_transfer.p2p import settings
from kvrelay.kv_transfer.transport.cuda_ipc import CudaIpcTransport
from kvrelay.kv_transfer.transport.ipc import HostIpc
from tests.kv_transfer.p2p.pd import BLOCK_SIZE, greedy, make_engine, prompt, reference_tokens, shutdown

IPC = {"backend": "cuda_ipc"}


@pytest.fixture
def transports(monkeypatch: pytest.MonkeyPatch) -> list[CudaIpcTransport]:  # overrides conftest's
    """Every engine built in the test gets a CudaIpcTransport on its own HostIpc seam."""
    created: list[CudaIpcTransport] = []

    def create(config: Any, transfer_config: Any, secret: bytes | None) -> CudaIpcTransport:
        assert config.backend == "cuda_ipc"
        transport = CudaIpcTransport(transfer_config.engine_id, transfer_config.kv_ip, secret=secret,
                                     timeout_s=config.transfer_timeout_seconds, ipc=HostIpc())
        created.append(transport)
        return transport

    monkeypatch.setattr(settings, "make_transport", create)
    yield created
    for transport in created:
        assert transport.ipc is not None and transport.ipc.opened == transport.ipc.closed, "handles left open"


def test_decode_reproduces_single_instance_through_cuda_ipc(make_pd, reference, transports) -> None:
    pd = make_pd(p_extra=IPC, d_extra=IPC)
    prompts = {"short": prompt(BLOCK_SIZE - 1), "exact": prompt(2 * BLOCK_SIZE, 1),
               "partial": prompt(2 * BLOCK_SIZE + 3, 2)}
    assert pd.run(prompts, max_tokens=5) == reference_tokens(reference, prompts, 5)
    assert pd.d.get_stats()["prompt_tokens_computed"] == len(prompts)
    assert transports[1].ipc is not None and transports[1].ipc.opened == len(pd.p.runner.kv_caches)
    pd.settle()
    assert pd.p.get_stats()["kv_lease_expired"] == 0


def test_a_slow_copy_aborted_midway_frees_d_blocks_only_after_it_settled(make_pd, transports) -> None:
    pd = make_pd(p_extra=IPC, d_extra=IPC)
    tokens = prompt(3 * BLOCK_SIZE, salt=9)
    params = pd.prefill(tokens, "p-read")
    d_ipc = transports[1].ipc
    assert isinstance(d_ipc, HostIpc)
    d_ipc.copy_delay_s = 0.5
    pd.d.add_request({"prompt_token_ids": tokens}, greedy(3), request_id="read", kv_transfer_params=params)
    pd.settle(until=lambda: bool(transports[1]._in_flight), timeout_s=10)
    pd.d.abort_request("read")
    pd.d.step()
    assert pd.d.blocks_in_use > 0  # NOTE: the copy may still land: the blocks wait for it
    pd.settle(timeout_s=10)
    assert pd.p.get_stats()["kv_lease_expired"] == 0  # the copy finished and told P


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_unopenable_handles_follow_the_failure_policy(make_pd, transports, reference, policy) -> None:
    # D never reads, so P frees the blocks when their lease runs out: a short one, for the test
    pd = make_pd(p_extra={**IPC, "lease_seconds": 1.0}, d_extra=IPC, d_policy=policy)
    d_ipc = transports[1].ipc
    assert isinstance(d_ipc, HostIpc)
    d_ipc.fail_open = True  # e.g. P is in another container, or on GPUs D cannot see
    tokens = prompt(2 * BLOCK_SIZE + 1, salt=15)
    out = pd.decode({"x": (tokens, pd.prefill(tokens, "p-x"))}, max_tokens=3)["x"]
    if policy == "recompute":
        assert out.outputs[0].token_ids == reference_tokens(reference, {"x": tokens}, 3)["x"]
    else:
        assert out.outputs[0].finish_reason == "error"
    assert pd.d.get_stats()["kv_load_failures"] == 1


def test_a_restarted_p_is_a_new_peer_whose_handles_are_opened_again(make_pd, transports, reference) -> None:
    pd = make_pd(p_extra=IPC, d_extra=IPC)
    first, second = prompt(2 * BLOCK_SIZE + 1, salt=17), prompt(2 * BLOCK_SIZE + 2, salt=18)
    pd.decode({"before": (first, pd.prefill(first, "p-0"))}, max_tokens=2)
    config = pd.p.config.kv_transfer
    shutdown(pd.p)
    pd.p = make_engine({"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_ip": "127.0.0.1",
                        "kv_port": config.kv_port, "engine_id": config.engine_id,
                        "kv_connector_extra_config": IPC})
    out = pd.decode({"after": (second, pd.prefill(second, "p-1"))}, max_tokens=3)["after"]
    assert out.outputs[0].token_ids == reference_tokens(reference, {"after": second}, 3)["after"]
    d_ipc = transports[1].ipc
    assert d_ipc is not None
    num_layers = len(pd.d.runner.kv_caches)
    assert d_ipc.opened == 2 * num_layers and d_ipc.closed == num_layers  # the old P's handles went

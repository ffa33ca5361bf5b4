"""NixlConnector with kv_buffer_device "cpu" (host staging) end to end: P stages a finished
request's blocks into its host mirror, a pin waits for them, D reads mirror to mirror over the
real TCP transport and copies them into its KV. On the CPU the "device" is host memory too, so
this proves the bookkeeping and the bytes, not the speed. The make_pd fixture checks zero blocks
in use and no thread left at the end."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay.kv_transfer.config import KVTransferConfig
from kvrelay.kv_transfer.p2p import settings
from kvrelay.kv_transfer.transport.base import KVTransport
from kvrelay.kv_transfer.transport.staging import StagedTransport
from tests.kv_transfer.p2p.pd import BLOCK_SIZE, make_engine, nixl_config, prompt, reference_tokens


@pytest.fixture
def transports(monkeypatch: pytest.MonkeyPatch) -> list[KVTransport]:  # overrides conftest's
    """Every engine gets the transport its config names (the real one), recorded in order."""
    created: list[KVTransport] = []

    def create(config: Any, transfer_config: Any, secret: bytes | None) -> KVTransport:
        transport = settings.build_transport(config, transfer_config, secret)
        created.append(transport)
        return transport

    monkeypatch.setattr(settings, "make_transport", create)
    return created


@pytest.fixture
def staged_pd(make_pd, monkeypatch):
    """make_pd, with kv_buffer_device "cpu" on both engines and backend tcp."""
    import tests.kv_transfer.conftest as conftest_module

    def staged_config(role: str, port: int | None = None, policy: str = "recompute", **extra: Any):
        config = nixl_config(role, port, policy, backend="tcp", **extra)
        return {**config, "kv_buffer_device": "cpu"}

    monkeypatch.setattr(conftest_module, "nixl_config", staged_config)
    return make_pd


def test_decode_reproduces_single_instance_through_host_staging(staged_pd, transports, reference) -> None:
    pd = staged_pd()
    prompts = {"short": prompt(BLOCK_SIZE - 1), "exact": prompt(2 * BLOCK_SIZE, 1),
               "partial": prompt(2 * BLOCK_SIZE + 3, 2)}
    assert pd.run(prompts, max_tokens=5) == reference_tokens(reference, prompts, 5)
    assert pd.d.get_stats()["prompt_tokens_computed"] == len(prompts)
    p_transport, d_transport = transports
    assert isinstance(p_transport, StagedTransport) and isinstance(d_transport, StagedTransport)
    assert p_transport.blocks_staged >= 1 + 2 + 3  # every held block went through P's mirror


def test_config_refuses_an_unknown_buffer_device_and_push_or_cuda_ipc_with_staging() -> None:
    with pytest.raises(ValueError, match="kv_buffer_device must be one of cuda, cpu"):
        KVTransferConfig(kv_buffer_device="gpu")
    with pytest.raises(ValueError, match="does not stage through host memory yet"):
        make_engine({"kv_connector": "NixlPushConnector", "kv_role": "kv_producer",
                     "kv_buffer_device": "cpu", "kv_connector_extra_config": {"backend": "tcp"}})
    from kvrelay.kv_transfer.p2p.settings import NixlConfig, build_transport

    with pytest.raises(ValueError, match="does not go with kv_buffer_device 'cpu'"):
        build_transport(NixlConfig.from_extra_config({"backend": "cuda_ipc"}),
                        KVTransferConfig(kv_buffer_device="cpu"), None)

"""Fixtures for NixlConnector tests: in-process P/D pairs with leak and thread checks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvrelay.kv_transfer.p2p import settings
from tests.kv_transfer.p2p.fake_transport import InProcessTransport
from tests.kv_transfer.p2p.pd import PD, kv_threads, make_engine, nixl_config


@pytest.fixture
def transports(monkeypatch: pytest.MonkeyPatch) -> list[InProcessTransport]:
    """Every engine built in the test gets an InProcessTransport; the list holds them in order."""
    created: list[InProcessTransport] = []

    def create(config: Any, transfer_config: Any, secret: bytes | None) -> InProcessTransport:
        transport = InProcessTransport()
        created.append(transport)
        return transport

    monkeypatch.setattr(settings, "make_transport", create)
    return created


@pytest.fixture
def make_pd(transports: list[InProcessTransport]) -> Iterator[Callable[..., PD]]:
    """make_pd(p_extra={}, d_extra={}, d_policy="recompute", p_model={}, p_engine={}, d_engine={})
    -> PD (p_engine / d_engine: more make_engine arguments). At the end of the test both engines
    must settle with zero blocks in use, and every side-channel thread must be gone."""
    pairs: list[PD] = []

    def build(p_extra: dict[str, Any] | None = None, d_extra: dict[str, Any] | None = None,
              d_policy: str = "recompute", p_model: dict[str, Any] | None = None,
              p_engine: dict[str, Any] | None = None, d_engine: dict[str, Any] | None = None) -> PD:
        p = make_engine(nixl_config("kv_producer", **(p_extra or {})), **(p_engine or {}), **(p_model or {}))
        d = make_engine(nixl_config("kv_consumer", policy=d_policy, **(d_extra or {})), **(d_engine or {}))
        pair = PD(p, d)
        pairs.append(pair)
        return pair

    yield build
    try:
        for pair in pairs:
            pair.settle()
            assert pair.p.blocks_in_use == 0, f"P leaked {pair.p.blocks_in_use} blocks"
            assert pair.d.blocks_in_use == 0, f"D leaked {pair.d.blocks_in_use} blocks"
    finally:
        for pair in pairs:
            pair.close()
    assert not kv_threads(), f"threads left behind: {kv_threads()}"


@pytest.fixture(scope="module")
def reference() -> Any:
    """A single instance without a connector: the tokens P/D must reproduce."""
    return make_engine(None)

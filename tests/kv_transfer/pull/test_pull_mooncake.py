"""The pull connector over the real Mooncake transport (backend "mooncake"): P and D engines in
one process, Transfer Engines on loopback with protocol tcp. Every test ends with zero blocks in
use on both engines and no kvrelay thread left."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.kv_transfer.p2p.pd import (
    BLOCK_SIZE,
    PD,
    greedy,
    kv_threads,
    make_engine,
    nixl_config,
    prompt,
    reference_tokens,
)
from tests.kv_transfer.transport.helpers import require_backend

pytestmark = pytest.mark.timeout(180)
SECRET = "mooncake-test-secret-0123456789"


@pytest.fixture
def mooncake_pd(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., PD]]:
    require_backend("mooncake")
    monkeypatch.setenv("KVRELAY_KV_SECRET", SECRET)
    pairs: list[PD] = []

    def build(**d_extra: Any) -> PD:
        p = make_engine(nixl_config("kv_producer", backend="mooncake"))
        d = make_engine(nixl_config("kv_consumer", backend="mooncake", **d_extra))
        pairs.append(PD(p, d))
        return pairs[-1]

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
    return make_engine(None)


def _stat(engine: Any, name: str) -> int:
    return int(engine.get_stats()[name])


def test_decode_over_mooncake_reproduces_a_single_instance(mooncake_pd, reference) -> None:
    pd = mooncake_pd()
    prompts = {"short": prompt(BLOCK_SIZE - 1, 40), "exact": prompt(3 * BLOCK_SIZE, 41),
               "partial": prompt(5 * BLOCK_SIZE + 3, 42), "long": prompt(11 * BLOCK_SIZE + 1, 43)}
    assert pd.run(prompts, max_tokens=5) == reference_tokens(reference, prompts, 5)
    assert _stat(pd.d, "kv_load_failures") == 0
    assert _stat(pd.d, "kv_transfer_bytes") > 0
    pd.settle()
    assert _stat(pd.p, "kv_lease_expired") == 0  # every read notified P over the side channel


def test_partial_local_prefix_hit_reads_only_the_missing_last_blocks(mooncake_pd, reference) -> None:
    pd = mooncake_pd()
    tokens = prompt(4 * BLOCK_SIZE + 2, salt=44)
    pd.decode({"warm": (tokens[:2 * BLOCK_SIZE + 1], None)}, max_tokens=1)  # D caches blocks 0-1
    params = pd.prefill(tokens, "p-part")
    out = pd.decode({"part": (tokens, params)}, max_tokens=5)["part"]
    assert out.outputs[0].token_ids == reference_tokens(reference, {"part": tokens}, 5)["part"]
    assert pd.d.get_stats()["prompt_tokens_cached"] == 2 * BLOCK_SIZE  # D's local hit
    # The usage reports P's own hit (vLLM's remote_prefill_cached_tokens): P computed it all.
    assert out.num_cached_tokens == params["remote_prefill_cached_tokens"] == 0
    assert _stat(pd.d, "kv_load_failures") == 0


def test_full_local_prefix_hit_sends_only_the_notification(mooncake_pd, reference) -> None:
    pd = mooncake_pd()
    tokens = prompt(3 * BLOCK_SIZE, salt=45)
    pd.decode({"warm": (tokens, None)}, max_tokens=1)
    params = pd.prefill(tokens + [9], "p-hit")
    out = pd.decode({"hit": (tokens + [9], params)}, max_tokens=3)["hit"]
    assert out.outputs[0].token_ids == reference_tokens(reference, {"hit": tokens + [9]}, 3)["hit"]
    pd.settle()
    assert _stat(pd.p, "kv_lease_expired") == 0


@pytest.mark.parametrize("abort_after_steps", [0, 1, 3])
def test_aborts_at_any_point_of_the_pull_free_both_sides(mooncake_pd, reference, abort_after_steps) -> None:
    pd = mooncake_pd()
    tokens = prompt(6 * BLOCK_SIZE + 1, salt=46 + abort_after_steps)
    params = pd.prefill(tokens, "p-abort")
    pd.d.add_request({"prompt_token_ids": tokens}, greedy(3), request_id="abort", kv_transfer_params=params)
    for _ in range(abort_after_steps):
        pd.step()
    pd.d.abort_request("abort")
    pd.settle(timeout_s=20)
    assert _stat(pd.p, "kv_lease_expired") == 0  # released or read: P never waited for the lease
    again = pd.run({"again": tokens}, max_tokens=3)  # the engines still serve
    assert again == reference_tokens(reference, {"again": tokens}, 3)


def test_mooncake_options_are_checked_and_named() -> None:
    from kvrelay.kv_transfer.p2p.settings import NixlConfig

    config = NixlConfig.from_extra_config({"backend": "mooncake", "mooncake_protocol": "rdma",
                                           "mooncake_device": "mlx5_0"})
    assert config.mooncake_options() == {"protocol": "rdma", "device_name": "mlx5_0"}
    assert NixlConfig.from_extra_config({"backend": "tcp"}).mooncake_options() == {}
    with pytest.raises(ValueError, match="mooncake_protocol.*'ipoib'"):
        NixlConfig.from_extra_config({"backend": "mooncake", "mooncake_protocol": "ipoib"})
    with pytest.raises(ValueError, match="mooncake_device"):
        NixlConfig.from_extra_config({"backend": "mooncake", "mooncake_device": 0})


def test_backend_mooncake_without_the_wheel_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from kvrelay.kv_transfer.transport import create_transport

    monkeypatch.setitem(sys.modules, "mooncake", None)  # as if the wheel were absent
    monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)
    monkeypatch.delitem(sys.modules, "kvrelay.kv_transfer.transport.mooncake", raising=False)
    with pytest.raises(ValueError, match=r"kvrelay\[mooncake\]"):
        create_transport("mooncake", "engine-x")

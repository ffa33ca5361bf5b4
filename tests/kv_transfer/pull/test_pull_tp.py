"""NixlConnector between tensor-parallel instances: every combination of P tp x D tp in {1, 2}, over
TCP and NIXL (and Mooncake where installed), answers like a single instance, and so do tp 1 <-> 4
and a model with one KV head (replicated on every rank). Equal sizes pull rank to rank; a D rank
of a larger instance reads its heads' slice of one P rank's blocks; a D rank of a smaller one reads
from several P ranks; a replicated head is read once, and a P rank nobody reads from is told to
free at once. D computes only the last prompt token, and every instance ends with no block in use
on any rank. A failed read from one of several P ranks fails the request once, and D recomputes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvrelay.disagg.launcher import free_port_run
from kvrelay.engine.llm import LLM
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.kv_transfer.pull import puller
from kvrelay.kv_transfer.transport import nixl_available
from kvrelay.kv_transfer.transport.base import FinishedTransfer
from tests.kv_transfer.p2p.pd import BLOCK_SIZE, NUM_BLOCKS, PD, greedy, nixl_config, prompt
from tests.tiny import tiny_loaded_model

MAX_TOKENS = 5
EXTRA = {"backend": "tcp", "lease_seconds": 5.0, "heartbeat_seconds": 0.5}
NIXL = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")


class Engines:
    """Engines built on first use and kept for the module: (backend, role, tp, kv heads) -> engine."""

    def __init__(self) -> None:
        self.built: dict[tuple[str, str, int, int], LLMEngine] = {}
        self.references: dict[int, LLM] = {}

    def get(self, backend: str, role: str, tp: int, kv_heads: int = 2) -> LLMEngine:
        key = (backend, role, tp, kv_heads)
        if key not in self.built:
            self.built[key] = LLM(
                loaded_model=tiny_loaded_model(num_key_value_heads=kv_heads), block_size=BLOCK_SIZE,
                num_blocks=NUM_BLOCKS, max_num_batched_tokens=256, tensor_parallel_size=tp,
                kv_transfer_config=nixl_config(role, port=free_port_run("127.0.0.1", tp),
                                               **{**EXTRA, "backend": backend})).engine
        return self.built[key]

    def pair(self, backend: str, p_tp: int, d_tp: int, kv_heads: int = 2) -> PD:
        return PD(self.get(backend, "kv_producer", p_tp, kv_heads),
                  self.get(backend, "kv_consumer", d_tp, kv_heads))

    def reference(self, prompts: dict[str, list[int]], kv_heads: int = 2) -> dict[str, list[int]]:
        if kv_heads not in self.references:
            self.references[kv_heads] = LLM(loaded_model=tiny_loaded_model(num_key_value_heads=kv_heads),
                                            block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
        outs = self.references[kv_heads].generate([{"prompt_token_ids": p} for p in prompts.values()],
                                                  greedy(MAX_TOKENS), use_tqdm=False)
        return {rid: out.outputs[0].token_ids for rid, out in zip(prompts, outs, strict=True)}

    def close(self) -> None:
        for engine in self.built.values():
            engine.shutdown()
        for reference in self.references.values():
            reference.shutdown()


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    built = Engines()
    yield built
    built.close()


def _delta(before: dict[str, Any], after: dict[str, Any], key: str) -> float:
    return float(after[key] - before[key])


def _answers_like_one_instance(engines: Engines, pd: PD, prompts: dict[str, list[int]],
                               kv_heads: int = 2) -> None:
    """Greedy tokens equal a single instance's, D computed only the last prompt token of each
    request, nothing failed, P freed without waiting for a lease to expire, no block in use."""
    want = engines.reference(prompts, kv_heads)
    d_before, p_before = pd.d.get_stats(), pd.p.get_stats()
    assert pd.run(prompts, MAX_TOKENS) == want
    pd.settle(timeout_s=30)
    d_after, p_after = pd.d.get_stats(), pd.p.get_stats()
    assert _delta(d_before, d_after, "prompt_tokens_computed") == len(prompts)
    assert _delta(d_before, d_after, "prompt_tokens_external") == sum(len(p) - 1 for p in prompts.values())
    assert _delta(d_before, d_after, "kv_load_failures") == 0
    assert _delta(p_before, p_after, "kv_lease_expired") == 0
    assert pd.p.blocks_in_use == 0 and pd.d.blocks_in_use == 0


PAIRS = [(2, 2), (1, 2), (2, 1), (1, 1)]


@pytest.mark.parametrize("backend", ["tcp", pytest.param("nixl", marks=NIXL)])
@pytest.mark.parametrize("p_tp, d_tp", PAIRS)
def test_every_tp_pair_answers_like_one_instance(engines: Engines, backend: str, p_tp: int,
                                                 d_tp: int) -> None:
    salt = 10 * p_tp + d_tp + (50 if backend == "nixl" else 0)
    prompts = {f"{backend}{p_tp}{d_tp}-{i}": prompt(13 + 4 * i, salt=salt + i) for i in range(2)}
    _answers_like_one_instance(engines, engines.pair(backend, p_tp, d_tp), prompts)


@pytest.mark.parametrize("p_tp, d_tp", [(1, 2), (2, 1), (2, 2)])
def test_a_replicated_kv_head_is_read_once_and_every_p_rank_frees(engines: Engines, p_tp: int,
                                                                   d_tp: int) -> None:
    """One KV head, so every rank of a tp-2 instance holds all of it: each D rank reads it from one
    P rank; from tp 2 to tp 1, P's other rank is only told to free its blocks."""
    salt = 120 + 20 * p_tp + 4 * d_tp
    prompts = {f"rep{p_tp}{d_tp}-{i}": prompt(9 + 6 * i, salt=salt + i) for i in range(2)}
    _answers_like_one_instance(engines, engines.pair("tcp", p_tp, d_tp, kv_heads=1), prompts, kv_heads=1)


@pytest.mark.parametrize("p_tp, d_tp", [(1, 4), (4, 1)])
def test_tp1_and_tp4_pull_each_others_replicated_heads(engines: Engines, p_tp: int, d_tp: int) -> None:
    """Two KV heads over four ranks: two ranks hold each head. tp 4 -> 1 reads one replica of each
    head and releases the other two P ranks; tp 1 -> 4 has four D ranks read slices of one P rank."""
    prompts = {f"four{p_tp}{d_tp}": prompt(15, salt=90 + p_tp)}
    _answers_like_one_instance(engines, engines.pair("tcp", p_tp, d_tp), prompts)


def _sabotage_reads_from_p_rank_1(monkeypatch: pytest.MonkeyPatch, d: LLMEngine, how: str) -> None:
    """D (tp 1, in this process) fails its read from P's rank 1, or corrupts the checksum of it."""
    worker = d.runner.connector._worker  # type: ignore[attr-defined]
    transport = worker.transport
    if how == "read":
        real_read = transport.read_blocks

        def read_blocks(remote: str, *args: Any, **kwargs: Any) -> Any:
            if remote.endswith("#1"):
                return FinishedTransfer("injected read failure")
            return real_read(remote, *args, **kwargs)

        monkeypatch.setattr(transport, "read_blocks", read_blocks)
        return
    real_digests = puller.security.block_digests

    def block_digests(kv_layers: Any, block_ids: Any, ranges: Any = None) -> list[int]:
        sums = real_digests(kv_layers, block_ids, ranges)
        if ranges and ranges[0][0] != 0:  # P rank 1's heads land after P rank 0's
            sums[0] += 1
        return sums

    monkeypatch.setattr(puller.security, "block_digests", block_digests)


@pytest.mark.parametrize("how", ["read", "checksum"])
def test_one_p_ranks_failed_slice_fails_the_request_once_and_d_recomputes(
        engines: Engines, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    pd = engines.pair("tcp", 2, 1)
    _sabotage_reads_from_p_rank_1(monkeypatch, pd.d, how)
    prompts = {f"sabotage-{how}": prompt(14, salt=60 + len(how))}
    want = engines.reference(prompts)
    d_before, p_before = pd.d.get_stats(), pd.p.get_stats()
    assert pd.run(prompts, MAX_TOKENS) == want
    pd.settle(timeout_s=30)
    d_after, p_after = pd.d.get_stats(), pd.p.get_stats()
    assert _delta(d_before, d_after, "kv_load_failures") == 1
    computed = _delta(d_before, d_after, "prompt_tokens_computed")
    assert computed == 14  # nothing kept: a failed read, or block 0 (the first) failed its checksum
    assert _delta(p_before, p_after, "kv_lease_expired") == 0  # both P ranks freed: read, or released
    assert pd.p.blocks_in_use == 0 and pd.d.blocks_in_use == 0


@pytest.mark.parametrize("when", ["admitted", "loading"])
@pytest.mark.parametrize("p_tp, d_tp", [(2, 2), (2, 1), (1, 2)])
def test_abort_during_a_tp_load_releases_every_rank(engines: Engines, when: str, p_tp: int,
                                                    d_tp: int) -> None:
    """D aborts a request whose pulls (one per D rank and P rank it reads from) are in flight:
    every pull settles, the request ends aborted, and neither instance keeps a block on any rank."""
    pd = engines.pair("tcp", p_tp, d_tp)
    tokens = prompt(3 * BLOCK_SIZE + 1, salt=200 + 10 * p_tp + 3 * d_tp + len(when))
    rid = f"abort-{when}-{p_tp}{d_tp}"
    params = pd.prefill(tokens, f"p-{rid}")
    pd.d.add_request({"prompt_token_ids": tokens}, greedy(3), request_id=rid,
                     kv_transfer_params=params)
    pd.d.step()  # admitted: WAITING_FOR_REMOTE_KVS, the pulls are with both workers
    if when == "loading":
        pd.d.step()
    pd.d.abort_request(rid)
    pd.settle(timeout_s=30)
    assert rid not in pd.d.scheduler.requests
    assert pd.p.blocks_in_use == 0 and pd.d.blocks_in_use == 0


@pytest.mark.parametrize("p_tp, d_tp", [(2, 2), (2, 1)])
def test_tp_pairs_pull_over_mooncake(engines: Engines, p_tp: int, d_tp: int) -> None:
    """The Mooncake backend per rank: rank to rank between equal sizes, head slices of both P
    ranks into one D rank's blocks from tp 2 to tp 1."""
    from kvrelay.kv_transfer.transport.mooncake import mooncake_available
    loads, why = mooncake_available()
    if not loads:
        pytest.skip(why)
    prompts = {f"mc{p_tp}{d_tp}-{i}": prompt(14 + 5 * i, salt=70 + 2 * p_tp + d_tp + i) for i in range(2)}
    _answers_like_one_instance(engines, engines.pair("mooncake", p_tp, d_tp), prompts)

"""NixlPushConnector between tensor-parallel instances of equal size: P's rank r writes its heads
into D's rank r (side channel on kv_port + tp_rank), each rank's checksums are verified on that
rank, and a request settles only when every rank reported. Answers equal a single instance's;
one rank's failed write fails the request once and D recomputes it; unequal sizes are refused
naming both. Every instance ends with no block in use."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from kvrelay.engine.llm import LLM
from kvrelay.engine.llm_engine import LLMEngine
from tests.kv_transfer.nixl.pd import BLOCK_SIZE, NUM_BLOCKS, PD, greedy, prompt, reference_tokens
from tests.kv_transfer.nixl.push_faults import FAILING_MARK, failing_push_config
from tests.kv_transfer.nixl.test_pull_processes import BACKENDS
from tests.kv_transfer.nixl.test_push_processes import d_params, p_params, push_config
from tests.tiny import tiny_loaded_model

pytestmark = pytest.mark.timeout(240)
MAX_TOKENS = 4
# A short lease: P holds a request nobody registers for (a refused D) until it ends.
EXTRA = {"lease_seconds": 1.5, "heartbeat_seconds": 0.5}


def make_engine(config: dict[str, Any], tp: int) -> LLMEngine:
    return LLM(loaded_model=tiny_loaded_model(), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
               max_num_batched_tokens=256, tensor_parallel_size=tp, kv_transfer_config=config).engine


@pytest.fixture(scope="module")
def reference() -> Iterator[LLMEngine]:
    engine = LLM(loaded_model=tiny_loaded_model(), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS).engine
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module", params=BACKENDS[:2])
def tp2_pair(request: pytest.FixtureRequest) -> Iterator[tuple[PD, int, str]]:
    """P tp 2 (rank 1 fails the writes of transfers marked FAILING_MARK) and D tp 2."""
    backend = request.param
    p_config = failing_push_config(push_config("kv_producer", backend, **EXTRA))
    p = make_engine(p_config, 2)
    d = make_engine(push_config("kv_consumer", backend, **EXTRA), 2)
    yield PD(p, d), p_config["kv_port"], backend
    p.shutdown()
    d.shutdown()


def push_all(pd: PD, port: int, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Both legs of every prompt at once (the proxy's order: D's leg first); D's tokens."""
    for rid, tokens in prompts.items():
        pd.d.add_request({"prompt_token_ids": tokens}, greedy(MAX_TOKENS), request_id=rid,
                         kv_transfer_params=d_params(f"t-{rid}", port))
        pd.p.add_request({"prompt_token_ids": tokens}, greedy(1), request_id=f"p-{rid}",
                         kv_transfer_params=p_params(f"t-{rid}"))
    outs = pd.wait(pd.d, set(prompts), timeout_s=60)
    return {rid: out.outputs[0].token_ids for rid, out in outs.items()}


def settled_without_leaks(pd: PD) -> None:
    pd.settle(timeout_s=30)
    assert pd.p.blocks_in_use == 0 and pd.d.blocks_in_use == 0


def test_tp2_push_rank_to_rank_answers_like_one_instance(tp2_pair, reference) -> None:
    pd, port, _ = tp2_pair
    prompts = {f"ok-{i}": prompt(3 * BLOCK_SIZE + 2 + 5 * i, salt=80 + i) for i in range(2)}
    before = pd.d.get_stats()
    assert push_all(pd, port, prompts) == reference_tokens(reference, prompts, MAX_TOKENS)
    after = pd.d.get_stats()
    # D computed only each prompt's last token: every rank's blocks arrived and verified
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == len(prompts)
    assert after["kv_load_failures"] == before["kv_load_failures"]
    settled_without_leaks(pd)


def test_one_ranks_failed_write_fails_the_request_once_and_d_recomputes(tp2_pair, reference) -> None:
    pd, port, _ = tp2_pair
    tokens = prompt(4 * BLOCK_SIZE + 1, salt=90)
    before = pd.d.get_stats()
    got = push_all(pd, port, {f"{FAILING_MARK}-a": tokens})
    assert got == reference_tokens(reference, {f"{FAILING_MARK}-a": tokens}, MAX_TOKENS)
    after = pd.d.get_stats()
    assert after["kv_load_failures"] - before["kv_load_failures"] == 1  # rank 1 only, policy once
    # the failed receive keeps no pushed block: rank 0's arrived, but rank 1's heads did not
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == len(tokens)
    settled_without_leaks(pd)


def test_a_tp_mismatch_is_refused_naming_both_sizes(tp2_pair, reference, caplog) -> None:
    pd2, port, backend = tp2_pair
    d1 = make_engine(push_config("kv_consumer", backend, **EXTRA), 1)
    pd = PD(pd2.p, d1)
    try:
        tokens = prompt(3 * BLOCK_SIZE + 3, salt=95)
        with caplog.at_level(logging.WARNING):
            got = push_all(pd, port, {"mismatch": tokens})
        assert got == reference_tokens(reference, {"mismatch": tokens}, MAX_TOKENS)
        assert "runs tensor_parallel_size 2 and this decode instance 1" in caplog.text
        assert d1.get_stats()["kv_load_failures"] == 1
        settled_without_leaks(pd)
    finally:
        d1.shutdown()

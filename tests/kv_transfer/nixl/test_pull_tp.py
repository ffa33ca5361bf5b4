"""NixlConnector (TCP transport) between tensor-parallel instances: every combination of P tp x D tp
in {1, 2} answers like a single instance. Equal sizes pull rank to rank (each rank's side channel
on kv_port + tp_rank) and D computes only the last prompt token; unequal sizes are refused with a
clear reason, the failure policy recomputes once, and P frees its blocks when the lease ends.
Every instance ends with no block in use."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay.engine.llm import LLM
from kvrelay.engine.llm_engine import LLMEngine
from tests.kv_transfer.nixl.pd import BLOCK_SIZE, NUM_BLOCKS, PD, greedy, nixl_config, prompt
from tests.tiny import tiny_loaded_model

MAX_TOKENS = 5
# A short lease: a refused (unequal TP) pull never reads, so P holds the blocks until it ends.
EXTRA = {"backend": "tcp", "lease_seconds": 1.5, "heartbeat_seconds": 0.5}


def make_engine(role: str, tp: int) -> LLMEngine:
    return LLM(loaded_model=tiny_loaded_model(), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
               max_num_batched_tokens=256, tensor_parallel_size=tp,
               kv_transfer_config=nixl_config(role, **EXTRA)).engine


@pytest.fixture(scope="module")
def engines() -> Any:
    built = {("p", tp): make_engine("kv_producer", tp) for tp in (1, 2)}
    built.update({("d", tp): make_engine("kv_consumer", tp) for tp in (1, 2)})
    reference = LLM(loaded_model=tiny_loaded_model(), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    yield built, reference
    for engine in built.values():
        engine.shutdown()
    reference.shutdown()


@pytest.mark.parametrize("p_tp, d_tp", [(2, 2), (1, 2), (2, 1), (1, 1)])
def test_every_tp_pair_answers_like_one_instance(engines: Any, p_tp: int, d_tp: int) -> None:
    built, reference = engines
    pd = PD(built[("p", p_tp)], built[("d", d_tp)])
    prompts = {f"{p_tp}{d_tp}-{i}": prompt(13 + 4 * i, salt=10 * p_tp + d_tp + i) for i in range(2)}
    want = {rid: out.outputs[0].token_ids for rid, out in zip(prompts, reference.generate(
        [{"prompt_token_ids": p} for p in prompts.values()],
        greedy(MAX_TOKENS), use_tqdm=False), strict=True)}
    before = pd.d.get_stats()
    assert pd.run(prompts, MAX_TOKENS) == want
    after = pd.d.get_stats()
    computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    external = after["prompt_tokens_external"] - before["prompt_tokens_external"]
    failures = after["kv_load_failures"] - before["kv_load_failures"]
    if p_tp == d_tp:  # D read everything but the last prompt token, rank to rank
        assert (computed, external, failures) == (len(prompts), sum(len(p) - 1 for p in prompts.values()), 0)
    else:  # refused on every D rank, recomputed once per request
        assert (computed, external, failures) == (sum(map(len, prompts.values())), 0, len(prompts))
    pd.settle(timeout_s=30)
    assert pd.p.blocks_in_use == 0 and pd.d.blocks_in_use == 0



@pytest.mark.parametrize("when", ["admitted", "loading"])
def test_abort_during_a_tp2_load_releases_every_rank(engines: Any, when: str) -> None:
    """D tp 2 aborts a request whose two rank pulls are in flight: both ranks settle, the request
    ends aborted, and neither instance keeps a block on any rank."""
    built, _ = engines
    pd = PD(built[("p", 2)], built[("d", 2)])
    tokens = prompt(3 * BLOCK_SIZE + 1, salt=40 + len(when))
    params = pd.prefill(tokens, f"p-abort-{when}")
    pd.d.add_request({"prompt_token_ids": tokens}, greedy(3), request_id=f"abort-{when}",
                     kv_transfer_params=params)
    pd.d.step()  # admitted: WAITING_FOR_REMOTE_KVS, the pulls are with both workers
    if when == "loading":
        pd.d.step()
    pd.d.abort_request(f"abort-{when}")
    pd.settle(timeout_s=30)
    assert f"abort-{when}" not in pd.d.scheduler.requests
    assert pd.p.blocks_in_use == 0 and pd.d.blocks_in_use == 0


def test_tp2_pair_pulls_rank_to_rank_over_mooncake() -> None:
    """The Mooncake backend per rank: each of D's ranks reads its KV heads from P's same rank."""
    from kvrelay.kv_transfer.transport.mooncake import mooncake_available
    loads, why = mooncake_available()
    if not loads:
        pytest.skip(why)
    extra = {**EXTRA, "backend": "mooncake"}
    p, d = (LLM(loaded_model=tiny_loaded_model(), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                max_num_batched_tokens=256, tensor_parallel_size=2,
                kv_transfer_config=nixl_config(role, **extra)).engine
            for role in ("kv_producer", "kv_consumer"))
    reference = LLM(loaded_model=tiny_loaded_model(), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    try:
        prompts = {f"mc-{i}": prompt(14 + 5 * i, salt=70 + i) for i in range(2)}
        want = {rid: out.outputs[0].token_ids for rid, out in zip(prompts, reference.generate(
            [{"prompt_token_ids": t} for t in prompts.values()], greedy(MAX_TOKENS), use_tqdm=False),
            strict=True)}
        pd = PD(p, d)
        assert pd.run(prompts, MAX_TOKENS) == want
        stats = d.get_stats()
        assert stats["prompt_tokens_computed"] == len(prompts) and stats["kv_load_failures"] == 0
        pd.settle(timeout_s=30)
        assert p.blocks_in_use == 0 and d.blocks_in_use == 0
    finally:
        for engine in (p, d):
            engine.shutdown()
        reference.shutdown()

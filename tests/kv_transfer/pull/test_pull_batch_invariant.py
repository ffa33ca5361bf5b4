"""NixlConnector and the batch-invariant mode (P and D in one process, the in-process transport):
with the mode on both sides D's logprobs are bitwise a single instance's; a P with the mode and a
D without are refused at the handshake, naming the numerics, and D recomputes the prompt."""

from __future__ import annotations

import logging

import pytest

from kvrelay.core.stats import SchedulerStats
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.metrics.prometheus import ServerMetrics
from kvrelay.sampling_params import SamplingParams
from tests.kv_transfer.p2p.pd import BLOCK_SIZE, PD, make_engine, prompt

MAX_TOKENS = 6
INVARIANT = {"batch_invariant": True}
# Shorter than a block, exactly two blocks, several with a partial last one.
PROMPTS = {"short": prompt(BLOCK_SIZE - 1, 20), "exact": prompt(2 * BLOCK_SIZE, 21),
           "partial": prompt(5 * BLOCK_SIZE + 3, 22)}


def with_logprobs(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)


def answers(engine: LLMEngine, outputs: dict[str, object]) -> dict[str, tuple[list[int], list[float]]]:
    """Each request's tokens and the logprob of each (as floats: compared for equality)."""
    result = {}
    for rid, out in outputs.items():
        completion = out.outputs[0]  # type: ignore[attr-defined]
        logprobs = [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs,
                                                                 strict=True)]
        result[rid] = (list(completion.token_ids), logprobs)
    return result


def run_pd(pd: PD) -> dict[str, tuple[list[int], list[float]]]:
    params = {rid: pd.prefill(tokens, f"p-{rid}") for rid, tokens in PROMPTS.items()}
    for rid, tokens in PROMPTS.items():
        pd.d.add_request({"prompt_token_ids": tokens}, with_logprobs(MAX_TOKENS), request_id=rid,
                         kv_transfer_params=params[rid])
    return answers(pd.d, pd.wait(pd.d, set(PROMPTS)))


def run_alone(engine: LLMEngine) -> dict[str, tuple[list[int], list[float]]]:
    """A single instance, each prompt on its own."""
    result = {}
    for rid, tokens in PROMPTS.items():
        engine.add_request({"prompt_token_ids": tokens}, with_logprobs(MAX_TOKENS), request_id=f"alone-{rid}")
        final = {}
        while engine.has_unfinished_requests():
            final.update({out.request_id: out for out in engine.step() if out.finished})
        result[rid] = answers(engine, {rid: final[f"alone-{rid}"]})[rid]
    engine.run_until_idle()
    return result


@pytest.fixture(scope="module")
def alone_invariant() -> dict[str, tuple[list[int], list[float]]]:
    return run_alone(make_engine(None, **INVARIANT))


@pytest.fixture(scope="module")
def alone_default() -> dict[str, tuple[list[int], list[float]]]:
    return run_alone(make_engine(None))


def test_with_the_mode_on_both_sides_d_reproduces_a_single_instances_logprobs_bitwise(
        make_pd, alone_invariant) -> None:
    pd = make_pd(p_engine=INVARIANT, d_engine=INVARIANT)
    assert run_pd(pd) == alone_invariant
    stats = pd.d.get_stats()
    # D computed only each prompt's last token (the one whose logits give the first output token).
    assert (stats["prompt_tokens_computed"], stats["kv_load_failures"]) == (len(PROMPTS), 0)
    assert stats["kv_transfer_incompatible"] == 0


def test_a_p_with_the_mode_and_a_d_without_are_refused_at_the_handshake_and_d_recomputes(
        make_pd, alone_default, caplog: pytest.LogCaptureFixture) -> None:
    pd = make_pd(p_engine=INVARIANT, p_extra={"lease_seconds": 1.0})
    with caplog.at_level(logging.WARNING):
        got = run_pd(pd)
    assert got == alone_default  # D's own numerics, the whole prompt computed by D
    stats = pd.d.get_stats()
    assert stats["prompt_tokens_computed"] == sum(map(len, PROMPTS.values()))
    assert stats["prompt_tokens_external"] == 0
    assert stats["kv_load_failures"] == len(PROMPTS)
    assert stats["kv_transfer_incompatible"] == 1  # the three loads shared one (refused) handshake
    refusals = [r.getMessage() for r in caplog.records if "numerics differs" in r.getMessage()]
    assert refusals and "ours 'default'" in refusals[0] and "batch-invariant-v1" in refusals[0], refusals
    assert "--batch-invariant" in refusals[0]  # the fix
    scraped = ServerMetrics(lambda: stats).render()[0].decode()
    assert "kvrelay_kv_transfer_incompatible_total 1.0" in scraped
    pd.settle()  # P frees its blocks when their lease (1 s) runs out: nobody read them


def test_the_incompatible_handshake_count_reaches_the_scheduler_stats() -> None:
    stats = SchedulerStats()
    stats.absorb_connector_stats({"handshakes_incompatible": 2, "load_failures": 2})
    assert (stats.kv_transfer_incompatible, stats.kv_transfer_failures) == (2, 2)


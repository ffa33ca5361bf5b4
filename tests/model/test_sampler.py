from collections import Counter

import pytest
import torch

from kvrelay.model import sampler as sampler_module
from kvrelay.model.sampler import (
    Sampler,
    SamplingRow,
    apply_penalties,
    apply_top_k_top_p,
    make_generator,
)
from kvrelay.sampling_params import SamplingParams


def make_row(params: SamplingParams | None = None, prompt: list[int] | None = None,
             output: list[int] | None = None, eos: tuple[int, ...] = (),
             generator: torch.Generator | None = None) -> SamplingRow:
    params = params or SamplingParams()
    if generator is None and params.seed is not None:
        generator = make_generator(params.seed)
    return SamplingRow(params=params, prompt_token_ids=prompt or [], output_token_ids=output or [],
                       eos_token_ids=eos, generator=generator)


def random_logits(n: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab_size, generator=make_generator(seed)) * 3


def sample_counts(logits_row: list[float], params: SamplingParams, n: int) -> Counter[int]:
    """Sample n times from one distribution, as n identical rows of one batch."""
    logits = torch.tensor([logits_row]).expand(n, -1).contiguous()
    token_ids, _ = Sampler(seed=0)(logits, [make_row(params) for _ in range(n)])
    return Counter(token_ids)


PROBS = [0.5, 0.3, 0.15, 0.05]
LOG_PROBS = torch.tensor(PROBS).log().tolist()


# ---- greedy and its equivalents ------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 1e-6])
def test_greedy_is_argmax(temperature):
    logits = random_logits(8, 100)
    token_ids, logprobs = Sampler()(logits, [make_row(SamplingParams(temperature=temperature))] * 8)
    assert token_ids == logits.argmax(dim=-1).tolist()
    assert logprobs == [None] * 8


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6),
                                    SamplingParams(min_p=1.0), SamplingParams(top_k=1, top_p=0.5)])
def test_truncation_to_one_token_is_greedy(params):
    logits = random_logits(16, 500, seed=1)
    token_ids, _ = Sampler(seed=0)(logits, [make_row(params) for _ in range(16)])
    assert token_ids == logits.argmax(dim=-1).tolist()


def test_mixed_batch_greedy_rows_stay_argmax():
    logits = random_logits(6, 300, seed=2)
    rows = [make_row(SamplingParams(temperature=0.0 if i % 2 else 1.0)) for i in range(6)]
    token_ids, _ = Sampler(seed=0)(logits, rows)
    argmax = logits.argmax(dim=-1).tolist()
    assert [token_ids[i] for i in (1, 3, 5)] == [argmax[i] for i in (1, 3, 5)]


# ---- random sampling -----------------------------------------------------------------------

def test_temperature_one_matches_softmax():
    n = 20_000
    counts = sample_counts(LOG_PROBS, SamplingParams(temperature=1.0), n)
    for token_id, p in enumerate(PROBS):
        assert abs(counts[token_id] / n - p) < 0.02


def test_low_temperature_is_sharper():
    n = 20_000
    counts = sample_counts(LOG_PROBS, SamplingParams(temperature=0.5), n)
    expected = torch.tensor(LOG_PROBS).div(0.5).softmax(dim=-1).tolist()
    assert counts[0] / n > PROBS[0] + 0.1
    for token_id, p in enumerate(expected):
        assert abs(counts[token_id] / n - p) < 0.02


def test_top_k_keeps_k_tokens_renormalised():
    n = 10_000
    counts = sample_counts(LOG_PROBS, SamplingParams(top_k=2), n)
    assert set(counts) == {0, 1}
    assert abs(counts[0] / n - 0.5 / 0.8) < 0.03


def test_top_p_keeps_smallest_set_reaching_p():
    # mass before token 1 is 0.5 < 0.7 (kept); before token 2 it is 0.8 >= 0.7 (dropped)
    counts = sample_counts(LOG_PROBS, SamplingParams(top_p=0.7), 5_000)
    assert set(counts) == {0, 1}


def test_min_p_never_samples_below_threshold():
    # min_p=0.2 of the top probability 0.5 -> tokens under 0.1 (token 3) are excluded
    counts = sample_counts(LOG_PROBS, SamplingParams(min_p=0.2), 5_000)
    assert set(counts) == {0, 1, 2}


def test_sampler_seed_makes_unseeded_rows_reproducible():
    logits = random_logits(32, 1000, seed=3)
    rows = [make_row() for _ in range(32)]
    assert Sampler(seed=7)(logits, rows)[0] == Sampler(seed=7)(logits, rows)[0]
    assert Sampler(seed=7)(logits, rows)[0] != Sampler(seed=8)(logits, rows)[0]


def test_caller_logits_are_not_modified():
    logits = random_logits(4, 50)
    before = logits.clone()
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=1.0, top_p=0.5, min_p=0.1,
                            min_tokens=3)
    Sampler(seed=0)(logits, [make_row(params, prompt=[1, 2], output=[3], eos=(4,))] * 4)
    assert torch.equal(logits, before)


# ---- per-request seeds ---------------------------------------------------------------------

def _run_seeded(position: int, batch: list[SamplingParams], steps: int = 6) -> list[int]:
    """Sample `steps` tokens for a seed=123 request placed at `position` among `batch`."""
    target = SamplingParams(seed=123, top_p=0.9, top_k=400)
    rows = [make_row(p) for p in batch]
    rows.insert(position, make_row(target))
    sampler = Sampler()  # unseeded rows use the global RNG: must not disturb the seeded one
    tokens = []
    for step in range(steps):
        logits = random_logits(len(rows), 1000, seed=100 + step)
        logits[position] = random_logits(1, 1000, seed=step)[0]  # the target's own logits
        token_ids, _ = sampler(logits, rows)
        tokens.append(token_ids[position])
        for row, token_id in zip(rows, token_ids, strict=True):
            row.output_token_ids.append(token_id)
    return tokens


def test_seeded_request_ignores_batch_composition():
    alone = _run_seeded(0, [])
    others = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(seed=5),
              SamplingParams(temperature=0.7, min_p=0.05), SamplingParams(repetition_penalty=1.3)]
    assert _run_seeded(0, others) == alone
    assert _run_seeded(3, others) == alone
    assert _run_seeded(5, others) == alone
    # a row with top_p but no top_k makes the batch take the full-sort path instead of top-k
    assert _run_seeded(1, [SamplingParams(top_p=0.5), SamplingParams(top_k=900)]) == alone


def test_different_seeds_give_different_tokens():
    logits = random_logits(1, 1000)
    seq = [Sampler()(logits, [make_row(SamplingParams(seed=s))])[0][0] for s in range(8)]
    assert len(set(seq)) > 1


# ---- penalties and min_tokens --------------------------------------------------------------

def test_penalties_exact_values():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, -1.0],
                           [2.0, -2.0, 1.0, 0.5, -1.0],
                           [2.0, -2.0, 1.0, 0.5, -1.0]])
    out = apply_penalties(
        logits.clone(),
        prompt_token_ids=[[0, 1], [0], []],
        output_token_ids=[[2, 2, 3], [1], []],
        presence=torch.tensor([0.5, 1.0, 1.0]),
        frequency=torch.tensor([0.25, 0.0, 1.0]),
        repetition=torch.tensor([2.0, 1.0, 2.0]),
    )
    # row 0: repetition over prompt+output {0,1,2,3}: 2/2, -2*2, 1/2, 0.5/2; then over output
    #        token 2 (x2): -0.25*2 - 0.5, token 3 (x1): -0.25 - 0.5
    # row 1: presence only over output: token 1 -> -2 - 1; prompt token 0 untouched
    # row 2: nothing seen, nothing changes
    expected = torch.tensor([[1.0, -4.0, -0.5, -0.5, -1.0],
                             [2.0, -3.0, 1.0, 0.5, -1.0],
                             [2.0, -2.0, 1.0, 0.5, -1.0]])
    torch.testing.assert_close(out, expected)


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert Sampler()(logits, [make_row(params, prompt=[0])])[0] == [1]
    assert Sampler()(logits, [make_row(SamplingParams(temperature=0.0), prompt=[0])])[0] == [0]


def test_min_tokens_suppresses_eos_and_stop_token_ids():
    logits = torch.tensor([[0.0, 9.0, 1.0, 8.0, 0.5]])  # eos=1 and stop id 3 are the favourites
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    assert Sampler()(logits, [make_row(params, output=[0], eos=(1,))])[0] == [2]
    assert Sampler()(logits, [make_row(params, output=[0, 0], eos=(1,))])[0] == [1]


def test_min_tokens_suppression_holds_for_random_rows():
    logits = torch.tensor([[0.0, 9.0, 1.0, 8.0, 0.5]])
    params = SamplingParams(min_tokens=5, stop_token_ids=[3])
    rows = [make_row(params, eos=(1,)) for _ in range(500)]
    token_ids, _ = Sampler(seed=0)(logits.expand(500, -1), rows)
    assert not {1, 3} & set(token_ids)


# ---- logprobs ------------------------------------------------------------------------------

def test_logprobs_come_from_raw_logits():
    logits = random_logits(3, 200, seed=4)
    params = SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.5, logprobs=5)
    rows = [make_row(params, prompt=[1, 2, 3]), make_row(SamplingParams()), make_row(params)]
    token_ids, logprobs = Sampler(seed=0)(logits, rows)
    raw = logits.log_softmax(dim=-1)
    assert logprobs[1] is None
    for i in (0, 2):
        lp = logprobs[i]
        assert lp is not None
        assert lp.token_ids[0] == token_ids[i]
        assert lp.logprobs[0] == pytest.approx(raw[i, token_ids[i]].item(), abs=1e-5)
        top = raw[i].topk(5)
        assert lp.token_ids[1:] == top.indices.tolist()
        assert lp.logprobs[1:] == pytest.approx(top.values.tolist(), abs=1e-5)
        assert lp.logprobs[1:] == sorted(lp.logprobs[1:], reverse=True)
        assert lp.sampled_rank == int((raw[i] > raw[i, token_ids[i]]).sum()) + 1


def test_greedy_sampled_token_has_rank_one():
    logits = random_logits(2, 100)
    _, logprobs = Sampler()(logits, [make_row(SamplingParams(temperature=0, logprobs=3))] * 2)
    assert all(lp is not None and lp.sampled_rank == 1 and lp.token_ids[0] == lp.token_ids[1]
               for lp in logprobs)


def test_logprobs_zero_returns_only_sampled_token():
    logits = random_logits(2, 100)
    rows = [make_row(SamplingParams(logprobs=0)), make_row(SamplingParams(logprobs=2))]
    token_ids, logprobs = Sampler(seed=0)(logits, rows)
    assert logprobs[0] is not None and logprobs[0].token_ids == [token_ids[0]]
    assert len(logprobs[0].logprobs) == 1
    assert logprobs[1] is not None and len(logprobs[1].token_ids) == 3


def test_logits_shape_must_match_rows():
    with pytest.raises(ValueError, match="len\\(rows\\)=2"):
        Sampler()(torch.zeros(3, 10), [make_row(), make_row()])


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_candidate_shortcut_equals_full_sort(monkeypatch, top_p):
    logits = random_logits(8, 2000, seed=5) * torch.linspace(0.2, 2.0, 8).unsqueeze(1)
    rows = [make_row(SamplingParams(top_p=top_p)) for _ in range(8)]
    monkeypatch.setattr(sampler_module, "_TOP_P_CANDIDATES", 4)  # most rows spill to the sort
    shortcut = apply_top_k_top_p(logits.clone(), rows)
    monkeypatch.setattr(sampler_module, "_TOP_P_CANDIDATES", 2000)  # every row fully sorted
    full = apply_top_k_top_p(logits.clone(), rows)
    assert torch.equal(shortcut, full)
    # one row alone gives the bits it gives in the batch
    assert torch.equal(apply_top_k_top_p(logits[3:4].clone(), rows[:1]), full[3:4])

"""Sampler: one step's logits -> one token per sequence, plus optional logprobs.

Processing order, per row:
    min_tokens suppression -> repetition penalty -> presence/frequency penalties
    -> greedy: argmax
    -> random: temperature -> top-k -> top-p -> min-p -> Gumbel-max draw

Every stage is vectorised over the rows that need it and skipped when none do, so the common
batches stay cheap: an all-greedy batch without penalties is a single argmax; penalty counts are
built (one bincount) only for penalised rows; top-k is a partial sort, and top-p sorts the whole
vocabulary only for rows whose nucleus is wider than the top candidates.

Sampling uses the exponential-race form of the Gumbel-max trick: with q ~ Exp(1) per token,
argmax(p / q) = argmax(logit - log q) is a draw from softmax(logit). A row with a seed draws its
noise from its own generator, so its tokens depend only on its seed and its step history, never on
which other rows share the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvrelay.outputs import TokenLogprobs
from kvrelay.sampling_params import SamplingParams

_NEG_INF = float("-inf")
_TINY = torch.finfo(torch.float32).tiny
_SEED_MASK = (1 << 64) - 1
# Top-p looks at this many of the most likely tokens before falling back to a full sort.
_TOP_P_CANDIDATES = 1024


@dataclass
class SamplingRow:
    """One sequence that samples this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far, not including this step
    # Suppressed (logit -inf), together with params.stop_token_ids, until min_tokens are out.
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None  # per-request generator when params.seed is set


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one seeded request; the engine keeps it across the request's steps."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & _SEED_MASK)  # manual_seed rejects negatives and > 64 bits
    return generator


class Sampler:
    def __init__(self, seed: int | None = None):
        # Engine-level generator for random rows without a seed; None uses torch's global RNG.
        self.seed = seed
        self._generator: torch.Generator | None = None

    def __call__(self, logits: torch.Tensor,
                 rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [N, V], row i <-> rows[i]. Returns the sampled token per row and, for rows
        that asked for them, logprobs of the *raw* logits (before penalties and temperature)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got {tuple(logits.shape)}")
        logits = logits.float()  # no-op for float32
        processed = apply_logits_processors(logits, rows)
        token_ids = self._choose_tokens(processed, rows).tolist()
        return token_ids, compute_logprobs(logits, token_ids, rows)

    def _choose_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        random_idx = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if not random_idx:
            return logits.argmax(dim=-1)
        if len(random_idx) == len(rows):
            return self._sample_random(logits, rows)
        token_ids = logits.argmax(dim=-1)  # greedy rows; the random rows are overwritten below
        idx = torch.tensor(random_idx, device=logits.device)
        token_ids[idx] = self._sample_random(logits[idx], [rows[i] for i in random_idx])
        return token_ids

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        temperatures = _row_tensor([r.params.temperature for r in rows], logits.device)
        scaled = logits / temperatures.unsqueeze(1)  # a fresh tensor: the masks below work in place
        scaled = apply_top_k_top_p(scaled, rows)
        scaled = apply_min_p(scaled, rows)
        return scaled.add_(self._gumbel_noise(rows, logits.shape[1], logits.device)).argmax(dim=-1)

    def _gumbel_noise(self, rows: list[SamplingRow], vocab_size: int,
                      device: torch.device) -> torch.Tensor:
        """-log(q) with q = -log(u) ~ Exp(1), u ~ U[0, 1): argmax(logit - log q) = argmax(p / q).
        (Uniform draws plus two logs are several times faster than exponential_ on CPU.)"""
        u = torch.empty(len(rows), vocab_size, device=device)  # [n, V]
        unseeded = [i for i, row in enumerate(rows) if row.generator is None]
        if len(unseeded) == len(rows):
            u.uniform_(generator=self._engine_generator(device))
        elif unseeded:
            draw = torch.empty(len(unseeded), vocab_size, device=device)
            u[unseeded] = draw.uniform_(generator=self._engine_generator(device))
        for i, row in enumerate(rows):
            if row.generator is not None:
                # Drawn on the generator's own device so the stream is the same wherever it runs.
                draw = torch.empty(vocab_size, device=row.generator.device)
                u[i] = draw.uniform_(generator=row.generator).to(device)
        # NOTE: u = 0 (odds 2**-24 per float32 draw) would give noise -inf, and a row whose only
        # surviving token drew it would argmax to token 0. Clamping keeps every noise finite.
        return u.clamp_min_(_TINY).log_().neg_().log_().neg_()

    def _engine_generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        if self._generator is None or self._generator.device != device:
            self._generator = make_generator(self.seed, device)
        return self._generator


def apply_logits_processors(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """min_tokens suppression and penalties. Returns `logits` itself when no row needs either,
    otherwise a modified copy (the raw logits are still needed for logprobs)."""
    suppressed = [(i, _stop_ids(row)) for i, row in enumerate(rows)
                  if len(row.output_token_ids) < row.params.min_tokens]
    penalised = [i for i, row in enumerate(rows) if _has_penalties(row.params)]
    if not suppressed and not penalised:
        return logits
    logits = logits.clone()
    if suppressed:
        _suppress_tokens(logits, suppressed)
    if penalised:
        idx = torch.tensor(penalised, device=logits.device)
        params = [rows[i].params for i in penalised]
        logits[idx] = apply_penalties(
            logits[idx],
            [rows[i].prompt_token_ids for i in penalised],
            [rows[i].output_token_ids for i in penalised],
            presence=_row_tensor([p.presence_penalty for p in params], logits.device),
            frequency=_row_tensor([p.frequency_penalty for p in params], logits.device),
            repetition=_row_tensor([p.repetition_penalty for p in params], logits.device),
        )
    return logits


def apply_penalties(logits: torch.Tensor, prompt_token_ids: list[list[int]],
                    output_token_ids: list[list[int]], presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Penalise tokens already seen; modifies `logits` [n, V] in place and returns it.

    Repetition (HF/vLLM): every token of prompt + output has its logit divided by the penalty
    when positive, multiplied when negative. Presence and frequency (OpenAI): over output tokens
    only, logit -= presence * [count > 0] + frequency * count. Penalty tensors are [n].
    """
    n, vocab_size = logits.shape
    output_counts = _token_counts(output_token_ids, vocab_size, logits.device)  # [n, V]
    if bool((repetition != 1.0).any()):
        prompt_counts = _token_counts(prompt_token_ids, vocab_size, logits.device)  # [n, V]
        seen = (prompt_counts + output_counts) > 0
        penalty = repetition.unsqueeze(1)  # [n, 1]
        factor = torch.where(logits > 0, 1.0 / penalty, penalty)  # [n, V]
        logits.mul_(factor.masked_fill_(~seen, 1.0))
    counts = output_counts.to(logits.dtype)
    logits -= frequency.unsqueeze(1) * counts
    logits -= presence.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Keep each row's top-k tokens, then the smallest set of those whose renormalised
    probability reaches top_p; in place on `logits` [n, V], which is returned.

    No row's result depends on the other rows: a seeded request must sample the same tokens
    in any batch. So the rows are grouped by their own parameters, never by the batch's, and
    masses are prefix sums (whose rounding does not depend on the row count) instead of sums.
    """
    vocab_size = logits.shape[1]
    with_k = [i for i, r in enumerate(rows) if 0 < r.params.top_k < vocab_size]
    top_p_only = [i for i, r in enumerate(rows)
                  if r.params.top_p < 1.0 and not 0 < r.params.top_k < vocab_size]
    if with_k:
        # top_p == 1 becomes +inf so that rounding can never cut the tail of a top-k-only row.
        k = torch.tensor([rows[i].params.top_k for i in with_k], device=logits.device)
        p = _row_tensor([rows[i].params.top_p if rows[i].params.top_p < 1.0 else math.inf
                         for i in with_k], logits.device)
        _update_rows(logits, with_k, lambda x: _truncate_top_k(x, k, p))
    if top_p_only:
        p = _row_tensor([rows[i].params.top_p for i in top_p_only], logits.device)
        _update_rows(logits, top_p_only, lambda x: _truncate_top_p(x, p))
    return logits


def _truncate_top_k(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    values, token_ids = logits.topk(int(k.max()), dim=-1)  # [n, K], descending
    position = torch.arange(values.shape[1], device=logits.device)
    values.masked_fill_(position >= k.unsqueeze(1), _NEG_INF)  # each row's own k
    weights = (values - values[:, :1]).exp()  # [n, K]; 0 past the row's k
    total_mass = weights.cumsum(dim=-1)[:, -1:]  # [n, 1]: the top-k survivors' mass
    values, _ = _mask_top_p(values, p, total_mass)
    return torch.full_like(logits, _NEG_INF).scatter_(1, token_ids, values)


def _truncate_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    # A full sort of the vocabulary is the slow part, and real nuclei are small: look at the
    # top candidates first and sort the whole row only when they do not reach top_p.
    total_mass = (logits - logits.amax(dim=-1, keepdim=True)).exp().cumsum(dim=-1)[:, -1:]  # [n, 1]
    values, token_ids = logits.topk(min(_TOP_P_CANDIDATES, logits.shape[1]), dim=-1)  # [n, C]
    values, reached_p = _mask_top_p(values, p, total_mass)
    out = torch.full_like(logits, _NEG_INF).scatter_(1, token_ids, values)
    if not bool(reached_p.all()):
        spill = (~reached_p).nonzero().squeeze(1)
        values, token_ids = logits[spill].sort(dim=-1, descending=True)  # [s, V]
        values, _ = _mask_top_p(values, p[spill], total_mass[spill])
        out[spill] = torch.full_like(values, _NEG_INF).scatter_(1, token_ids, values)
    return out


def _mask_top_p(values: torch.Tensor, p: torch.Tensor,
                total_mass: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [n, C]: logits sorted descending. Drops each token whose preceding mass already
    reaches p * total_mass [n, 1]; the first token always stays. Also returns, per row, whether
    the C tokens reach that mass (so no token beyond them could be kept either)."""
    weights = (values - values[:, :1]).exp()  # [n, C]: unnormalised probabilities
    cumulative = weights.cumsum(dim=-1)
    threshold = p.unsqueeze(1) * total_mass  # [n, 1]
    values.masked_fill_(cumulative - weights >= threshold, _NEG_INF)
    return values, cumulative[:, -1] >= threshold[:, 0]


def _update_rows(logits: torch.Tensor, idx: list[int],
                 fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    if len(idx) == logits.shape[0]:
        logits.copy_(fn(logits))
    else:
        index = torch.tensor(idx, device=logits.device)
        logits[index] = fn(logits[index])


def apply_min_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's, in place.
    p_i / p_max = exp(l_i - l_max), so the test needs no softmax."""
    min_p = [r.params.min_p for r in rows]
    if not any(min_p):
        return logits
    log_min_p = _row_tensor([math.log(m) if m > 0 else _NEG_INF for m in min_p], logits.device)
    threshold = logits.amax(dim=-1, keepdim=True) + log_min_p.unsqueeze(1)  # [n, 1]
    return logits.masked_fill_(logits < threshold, _NEG_INF)


def compute_logprobs(logits: torch.Tensor, token_ids: list[int],
                     rows: list[SamplingRow]) -> list[TokenLogprobs | None]:
    """Logprobs of the sampled token and the top-n, from the raw logits [N, V]."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(rows)
    if not wanted:
        return result
    raw = logits if len(wanted) == len(rows) else logits[torch.tensor(wanted, device=logits.device)]
    logprobs = raw.log_softmax(dim=-1)  # [n, V]
    sampled = torch.tensor([token_ids[i] for i in wanted], device=logits.device).unsqueeze(1)
    sampled_logprob = logprobs.gather(1, sampled)  # [n, 1]
    ranks = ((logprobs > sampled_logprob).sum(dim=-1) + 1).tolist()
    max_n = max(rows[i].params.logprobs or 0 for i in wanted)
    top_logprobs, top_ids = logprobs.topk(max_n, dim=-1)  # [n, max_n]; empty when max_n == 0
    top_logprobs_list, top_ids_list = top_logprobs.tolist(), top_ids.tolist()
    for j, (i, lp) in enumerate(zip(wanted, sampled_logprob.squeeze(1).tolist(), strict=True)):
        num_top = rows[i].params.logprobs or 0
        result[i] = TokenLogprobs(
            token_ids=[token_ids[i], *top_ids_list[j][:num_top]],
            logprobs=[lp, *top_logprobs_list[j][:num_top]],
            sampled_rank=ranks[j],
        )
    return result


def _has_penalties(params: SamplingParams) -> bool:
    return (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0)


def needs_token_history(params: SamplingParams) -> bool:
    """Whether sampling for `params` reads the request's prompt and output tokens (penalties,
    min_tokens); a row that does not may leave them empty."""
    return params.min_tokens > 0 or _has_penalties(params)


def _stop_ids(row: SamplingRow) -> list[int]:
    return [*row.eos_token_ids, *(row.params.stop_token_ids or ())]


def _suppress_tokens(logits: torch.Tensor, suppressed: list[tuple[int, list[int]]]) -> None:
    vocab_size = logits.shape[1]
    pairs = [(i, t) for i, ids in suppressed for t in ids if t < vocab_size]
    if pairs:
        row_idx, token_idx = zip(*pairs, strict=True)
        logits[list(row_idx), list(token_idx)] = _NEG_INF


def _token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[n, V] occurrence counts, from one bincount over the flattened (row, token) pairs."""
    lengths = torch.tensor([len(ids) for ids in token_ids], device=device)
    flat = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long, device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_ids), device=device), lengths)
    return torch.bincount(rows * vocab_size + flat, minlength=len(token_ids) * vocab_size).view(
        len(token_ids), vocab_size)


def _row_tensor(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)

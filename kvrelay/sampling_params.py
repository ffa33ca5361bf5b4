"""SamplingParams: how one request turns logits into tokens and when it stops.

Field names and defaults follow vLLM's SamplingParams so that request bodies written for vLLM
work unchanged. Every value is checked once, at construction; the sampler trusts them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Below this temperature a request is sampled greedily (dividing by ~0 would overflow).
_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_N = 16384  # vLLM's default cap on parallel samples per request
MAX_TEMPERATURE = 2.0  # OpenAI's range, which vLLM enforces too
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a seed must fit a signed 64-bit int


class SamplingParamTypeError(TypeError, ValueError):
    """A field of the wrong type. Also a ValueError, so a server that answers every ValueError
    with HTTP 400 treats `temperature="hot"` like `temperature=-1`."""


@dataclass
class SamplingParams:
    # Parallel samples from one prompt; the prompt is computed once (kvrelay.engine.parallel_sampling).
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None  # -1 means no seed, as in vLLM
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Normalised to a list in __post_init__; typed loosely so callers may pass a single string.
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's context length (the engine resolves it)
    min_tokens: int = 0
    logprobs: int | None = None  # top-n alternatives; 0 returns only the sampled token's logprob
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        if type(self.seed) is int and self.seed == -1:
            self.seed = None
        self.stop = _normalise_stop(self.stop)  # from here on always a list
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        self._check_types()
        self._check_ranges()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def _check_types(self) -> None:
        for name in ("n", "top_k", "min_tokens"):
            _require_int(name, getattr(self, name))
        for name in ("max_tokens", "logprobs", "seed"):
            if getattr(self, name) is not None:
                _require_int(name, getattr(self, name))
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            setattr(self, name, _require_float(name, getattr(self, name)))
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamTypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def _check_ranges(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if self.n > 1 and self.is_greedy:
            raise ValueError(f"n must be 1 when sampling greedily (temperature={self.temperature}), "
                             f"got {self.n}: n greedy samples would all be the same; raise the temperature")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be a signed 64-bit int in [{SEED_MIN}, {SEED_MAX}] (or -1 for "
                             f"none), got {self.seed}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs}")


def _normalise_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list | tuple):
        raise SamplingParamTypeError(f"stop must be a string, a list of strings or None, got {stop!r}")
    for s in stop:
        if not isinstance(s, str):
            raise SamplingParamTypeError(f"stop entries must be strings, got {s!r} in stop={stop!r}")
        if not s:
            raise ValueError(f"stop entries must be non-empty strings, got '' in stop={stop!r}")
    return list(stop)


def _normalise_stop_token_ids(ids: Any) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, list | tuple):
        raise SamplingParamTypeError(f"stop_token_ids must be a list of ints or None, got {ids!r}")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise SamplingParamTypeError(
                f"stop_token_ids entries must be ints, got {t!r} in stop_token_ids={ids!r}")
        if t < 0:
            raise ValueError(f"stop_token_ids entries must be >= 0, got {t} in stop_token_ids={ids!r}")
    return list(ids)


def _require_int(name: str, value: Any) -> None:
    # bool is an int subclass; True as a top_k is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamTypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")


def _require_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SamplingParamTypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return float(value)

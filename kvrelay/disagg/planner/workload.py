"""Workloads for the planner: a Mooncake JSONL trace or a synthetic Poisson stream.

A workload is a tuple of requests (arrival time, prompt and output lengths, and the prompt's
prefix-block ids when the trace carries them). Re-rating keeps the lengths and the order and
only changes when requests arrive, so the same requests can be offered at any rate.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512  # one Mooncake hash id names this many prompt tokens


@dataclass(frozen=True)
class RequestSpec:
    arrival_s: float
    input_len: int
    output_len: int
    # Ids of the prompt's leading blocks of `Workload.hash_block_tokens` tokens; equal ids are
    # an equal prefix (the chain is implied: Mooncake ids are already prefix-unique).
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Workload:
    requests: tuple[RequestSpec, ...]
    name: str = "workload"
    hash_block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError(f"workload {self.name!r} has no requests: give a trace with at least one "
                             "line or --num-requests >= 1")

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def rate(self) -> float:
        """Mean arrival rate (req/s); infinite when every request arrives at once."""
        span = self.duration_s
        return (len(self.requests) - 1) / span if span > 0 else math.inf

    def head(self, num_requests: int | None) -> Workload:
        if num_requests is None:
            return self
        if num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {num_requests}")
        return replace(self, requests=self.requests[:num_requests])

    def at_rate(self, rate: float, arrivals: str = "scaled", seed: int = 0) -> Workload:
        """The same requests arriving at `rate` req/s: 'scaled' stretches the trace's own
        timestamps (keeps its bursts), 'poisson' draws fresh exponential gaps."""
        if rate <= 0:
            raise ValueError(f"rate must be > 0 req/s, got {rate}")
        if arrivals == "poisson":
            times = poisson_arrivals(len(self.requests), rate, seed)
        elif arrivals == "scaled":
            own = self.rate
            if not math.isfinite(own):
                raise ValueError(f"workload {self.name!r} has no spread of timestamps to scale; "
                                 "use arrivals='poisson'")
            start = self.requests[0].arrival_s
            times = [(r.arrival_s - start) * own / rate for r in self.requests]
        else:
            raise ValueError(f"arrivals must be 'scaled' or 'poisson', got {arrivals!r}")
        return replace(self, requests=tuple(replace(r, arrival_s=t)
                                            for r, t in zip(self.requests, times, strict=True)))

    def without_prefixes(self) -> Workload:
        return replace(self, requests=tuple(replace(r, hash_ids=()) for r in self.requests))


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process: the first at 0, then exponential gaps."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for i in range(num_requests):
        if i:
            now += rng.expovariate(rate)
        times.append(now)
    return times


def load_mooncake_trace(path: str | Path) -> Workload:
    """Read a Mooncake JSONL trace (timestamp in ms, input_length, output_length, hash_ids)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file {path} does not exist")
    requests = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            requests.append(_parse_trace_line(line, path, lineno))
    if not requests:
        raise ValueError(f"trace {path} is empty: it needs one JSON object per line with timestamp, "
                         "input_length, output_length (and optionally hash_ids)")
    requests.sort(key=lambda r: r.arrival_s)
    return Workload(tuple(requests), name=path.stem)


def _parse_trace_line(line: str, path: Path, lineno: int) -> RequestSpec:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length") if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}; a Mooncake trace line has timestamp (ms), "
                         "input_length, output_length and hash_ids")
    input_len, output_len = obj["input_length"], obj["output_length"]
    for name, value in (("input_length", input_len), ("output_length", output_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {name} must be an integer >= 1, got {value!r}")
    hash_ids = obj.get("hash_ids") or []
    if not isinstance(hash_ids, list) or not all(isinstance(h, int) for h in hash_ids):
        raise ValueError(f"{where}: hash_ids must be a list of integers, got {hash_ids!r}")
    return RequestSpec(float(obj["timestamp"]) / 1e3, input_len, output_len, tuple(hash_ids))


def parse_length_dist(spec: str, what: str) -> tuple[str, float, float]:
    """'N' (fixed), 'A-B' (uniform integers), 'exp:MEAN' (exponential, at least 1)."""
    text = spec.strip()
    try:
        if text.startswith("exp:"):
            mean = float(text[4:])
            if mean >= 1:
                return ("exp", mean, 0.0)
        elif "-" in text:
            low, high = (int(x) for x in text.split("-", 1))
            if 1 <= low <= high:
                return ("uniform", low, high)
        elif int(text) >= 1:
            return ("fixed", int(text), 0.0)
    except ValueError:
        pass
    raise ValueError(f"{what} {spec!r} is not a length distribution: use N, A-B (uniform) or exp:MEAN, "
                     "all >= 1")


def _draw(dist: tuple[str, float, float], rng: random.Random) -> int:
    kind, a, b = dist
    if kind == "fixed":
        return int(a)
    if kind == "uniform":
        return rng.randint(int(a), int(b))
    return max(1, round(rng.expovariate(1.0 / a)))


def synthetic_workload(num_requests: int, rate: float, input_len: str, output_len: str,
                       seed: int = 0) -> Workload:
    """Poisson arrivals at `rate` with lengths drawn from the two distributions (no prefixes)."""
    if num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {num_requests}")
    rng = random.Random(seed)
    in_dist = parse_length_dist(input_len, "--input-len")
    out_dist = parse_length_dist(output_len, "--output-len")
    times = poisson_arrivals(num_requests, rate, seed + 1)
    requests = tuple(RequestSpec(t, _draw(in_dist, rng), _draw(out_dist, rng)) for t in times)
    return Workload(requests, name=f"poisson(in={input_len},out={output_len})")

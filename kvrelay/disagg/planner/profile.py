"""Latency profiles: kvrelay's own (measured by `kvrelay profile`) and DistServe's published ones.

kvrelay profile JSON (format "kvrelay-profile", version 1), all times in milliseconds:

    {"format": "kvrelay-profile", "version": 1,
     "model": "SmolLM2-135M-Instruct", "dtype": "float32", "threads": 2, "created": "...",
     "machine": {"hostname": ..., "cpus": ..., "torch": ...},
     "engine": {"block_size": 16, "num_blocks": 2730, "kv_bytes_per_token": 46080,
                "max_num_batched_tokens": 2048, "max_num_seqs": 64, "max_model_len": 8192},
     "gpus_per_instance": 1,
     "prefill": {"intercept_ms": a, "per_token_ms": b, "per_seq_ms": c, "per_kpair_ms": d},
     "decode":  {"intercept_ms": a, "per_token_ms": b, "per_seq_ms": 0, "per_kpair_ms": d},
     "decode_by_batch": {"1": ms, "2": ms, "3": ms, ...},
     "transfer": {"tcp": {"latency_ms": l, "ms_per_mib": m}, "nixl": {...}},
     "overhead_ms": {"request": r, "pd_hop": h, "step": s},
     "samples": {"prefill": [{"batch_tokens", "num_seqs", "prefix_tokens", "kpairs", "ms"}],
                 "decode": [{"batch_size", "total_context", "kpairs", "ms"}],
                 "transfer": [{"backend", "bytes", "ms"}]}}

One engine step that computes T new tokens for B sequences, where sequence i computes n_i
tokens after c_i already in its KV cache, costs

    intercept + per_token * T + per_seq * B + per_kpair * K,   K = sum_i n_i * (c_i + (n_i + 1) / 2) / 1000

(K counts query-key pairs of causal attention, in thousands), with the `prefill` coefficients
when any sequence computes prompt tokens and the `decode` ones when every n_i is 1, plus
`overhead_ms.step` (what a served step costs beyond the engine's: the server loop, streaming;
0 unless calibrated), the engine part multiplied by `step_time_scale` (1 unless calibrated: the
share of the profiled speed the instance gets where it runs). When the profile has
`decode_by_batch` (the measured cost of a decode step of B sequences without the context term,
per batch size sampled), a pure decode step costs
that, interpolated linearly between the sampled batch sizes, plus `per_kpair * K`: the engine
multiplies 1-2 rows and 3+ rows by different routes (kvrelay.model.layers.linear), so a decode
step of 3 sequences can be cheaper than one of 2, which no line through (B, ms) can say. A transfer
of X bytes costs latency + ms_per_mib * X / 2**20 on the chosen backend.

DistServe's format ({model: {tp: {prefill, decoding_smallbs, decoding_largebs, threshold}}}) is
read too; its latency formulas are in `distserve_prefill_ms` and `distserve_decode_ms`.
"""

from __future__ import annotations

import bisect
import csv
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROFILE_FORMAT = "kvrelay-profile"
PROFILE_VERSION = 1
DISTSERVE_DECODE_CONTEXT_LIMIT = 50_000  # tokens of context in one DistServe decode batch

# KV bytes per token (fp16 K and V, all layers) of the models DistServe profiled: 2 * layers * hidden * 2.
OPT_KV_BYTES_PER_TOKEN = {"facebook/opt-13b": 2 * 40 * 5120 * 2, "facebook/opt-66b": 2 * 64 * 9216 * 2,
                          "facebook/opt-175b": 2 * 96 * 12288 * 2}


@dataclass(frozen=True)
class StepFit:
    """Step time in ms = intercept + per_token*T + per_seq*B + per_kpair*K (see the module doc)."""

    intercept_ms: float
    per_token_ms: float
    per_seq_ms: float
    per_kpair_ms: float

    def predict_ms(self, num_tokens: int, num_seqs: int, kpairs: float) -> float:
        return (self.intercept_ms + self.per_token_ms * num_tokens + self.per_seq_ms * num_seqs
                + self.per_kpair_ms * kpairs)


@dataclass(frozen=True)
class TransferFit:
    latency_ms: float
    ms_per_mib: float

    def transfer_ms(self, num_bytes: float) -> float:
        return self.latency_ms + self.ms_per_mib * num_bytes / 2**20 if num_bytes > 0 else 0.0


@dataclass(frozen=True)
class DistServeCoeffs:
    prefill: tuple[float, float, float]
    decoding_smallbs: tuple[float, float, float]
    decoding_largebs: tuple[float, float, float]
    threshold: int = 95


def kpairs(chunks: Sequence[tuple[int, float]]) -> float:
    """Thousands of causal query-key pairs for chunks of (new tokens, tokens already cached)."""
    return sum(n * (c + (n + 1) / 2) for n, c in chunks) / 1000


def distserve_prefill_ms(c: DistServeCoeffs, lengths: Sequence[int], pp: int = 1) -> float:
    """DistServe's prefill time of a batch (its README): per stage (a + b*S + c*Q)/PP + PP, the
    first stage adding 2 + 1e-4*S; S = sum of lengths, Q = sum of squares. Stages run one after
    the other for one batch, so the batch's latency is the sum over stages."""
    a, b, cq = c.prefill
    s = sum(lengths)
    q = sum(x * x for x in lengths)
    return pp * ((a + b * s + cq * q) / pp + pp) + 2 + 1e-4 * s


def distserve_decode_ms(c: DistServeCoeffs, contexts: Sequence[int], pp: int = 1) -> float:
    """One DistServe decode step: per stage (a + b*C + c*B)/PP, C = sum of (context + 1);
    small-batch coefficients when B < threshold; the first stage adds 2 + 1e-4 * sum(context)."""
    batch = len(contexts)
    a, b, cb = c.decoding_smallbs if batch < c.threshold else c.decoding_largebs
    total = sum(x + 1 for x in contexts)
    return pp * ((a + b * total + cb * batch) / pp) + 2 + 1e-4 * sum(contexts)


@dataclass
class Profile:
    """One instance's latency model and capacity, measured or taken from DistServe's data."""

    model: str
    engine: dict[str, int]  # block_size, num_blocks, kv_bytes_per_token, max_num_batched_tokens, ...
    prefill: StepFit | None = None
    decode: StepFit | None = None
    transfer: dict[str, TransferFit] = field(default_factory=dict)
    overhead_ms: dict[str, float] = field(default_factory=lambda: {"request": 0.0, "pd_hop": 0.0})
    gpus_per_instance: int = 1
    dtype: str = "float32"
    threads: int | None = None
    created: str = ""
    machine: dict[str, Any] = field(default_factory=dict)
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    distserve: DistServeCoeffs | None = None  # set when read from DistServe's format
    # ms of a decode step of B sequences, less its per_kpair term, per sampled B (empty: the fit)
    decode_by_batch: dict[int, float] = field(default_factory=dict)
    # multiplies every engine step's time: the share of the profiled speed an instance gets
    # where it runs (1: as profiled; 2: half the speed, e.g. a CPU shared with other work)
    step_time_scale: float = 1.0
    # how much longer a step of each kind ("prefill", "decode") takes while another instance
    # computes on the same machine's other cores (empty: not measured; the simulator's
    # shared_host uses 1)
    co_run_slowdown: dict[str, float] = field(default_factory=dict)
    source: str = "measured"

    @property
    def block_size(self) -> int:
        return int(self.engine["block_size"])

    @property
    def num_blocks(self) -> int:
        return int(self.engine["num_blocks"])

    @property
    def kv_bytes_per_token(self) -> int:
        return int(self.engine["kv_bytes_per_token"])

    def step_ms(self, chunks: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float:
        """Time of one step computing prompt `chunks` (new tokens, cached tokens) and one token
        for each of the decoding sequences with `decode_contexts` tokens in their KV cache."""
        if self.distserve is not None:
            if chunks:  # a mixed step costs its prompt part plus one token per decode
                lengths = [n for n, _ in chunks] + [1] * len(decode_contexts)
                extra = _extra_prefix_ms(self.distserve, chunks)
                return distserve_prefill_ms(self.distserve, lengths) + extra
            return distserve_decode_ms(self.distserve, decode_contexts) if decode_contexts else 0.0
        assert self.prefill is not None and self.decode is not None
        pairs = kpairs([*chunks, *((1, c) for c in decode_contexts)])
        num_tokens = sum(n for n, _ in chunks) + len(decode_contexts)
        num_seqs = len(chunks) + len(decode_contexts)
        if not num_seqs:
            return 0.0
        if chunks:
            engine_ms = self.prefill.predict_ms(num_tokens, num_seqs, pairs)
        elif self.decode_by_batch:
            engine_ms = self.decode_base_ms(num_seqs) + self.decode.per_kpair_ms * pairs
        else:
            engine_ms = self.decode.predict_ms(num_tokens, num_seqs, pairs)
        return self.step_time_scale * max(0.0, engine_ms) + self.overhead_ms.get("step", 0.0)

    def decode_base_ms(self, batch: int) -> float:
        """A decode step of `batch` sequences without its context term, from `decode_by_batch`:
        linear between the sampled sizes, the smallest's below them, and beyond the largest its
        value plus the fit's per-sequence slope."""
        assert self.decode is not None and self.decode_by_batch
        sizes = sorted(self.decode_by_batch)
        table = self.decode_by_batch
        if batch <= sizes[0]:
            return table[sizes[0]]
        if batch >= sizes[-1]:
            slope = self.decode.per_token_ms + self.decode.per_seq_ms
            return table[sizes[-1]] + slope * (batch - sizes[-1])
        hi = bisect.bisect_left(sizes, batch)
        b0, b1 = sizes[hi - 1], sizes[hi]
        return table[b0] + (table[b1] - table[b0]) * (batch - b0) / (b1 - b0)

    def transfer_ms(self, num_bytes: float, backend: str) -> float:
        if backend not in self.transfer:
            known = ", ".join(sorted(self.transfer)) or "none"
            raise ValueError(f"profile of {self.model} has no transfer fit for backend {backend!r} "
                             f"(measured: {known}); profile again with it, or pass --link-bandwidth")
        return self.transfer[backend].transfer_ms(num_bytes)

    def to_json(self) -> dict[str, Any]:
        if self.distserve is not None:
            raise ValueError("a profile read from DistServe's format is not written back "
                             "as a kvrelay profile")
        out = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION}
        out.update({k: v for k, v in asdict(self).items() if k not in ("distserve", "source")})
        out["decode_by_batch"] = {str(b): ms for b, ms in sorted(self.decode_by_batch.items())}
        return out

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def _extra_prefix_ms(c: DistServeCoeffs, chunks: Sequence[tuple[int, int]]) -> float:
    # DistServe's quadratic term covers a prompt attending to itself; a chunk after c cached
    # tokens also attends to those: 2*n*c more pairs at the same per-pair cost.
    return c.prefill[2] * sum(2 * n * cached for n, cached in chunks)


_FIT_KEYS = ("intercept_ms", "per_token_ms", "per_seq_ms", "per_kpair_ms")
_ENGINE_KEYS = ("block_size", "num_blocks", "kv_bytes_per_token", "max_num_batched_tokens", "max_num_seqs")


def profile_from_json(obj: Any, where: str = "profile") -> Profile:
    """Check and read a kvrelay profile; a bad field raises ValueError naming it."""
    if not isinstance(obj, dict) or obj.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{where} is not a kvrelay profile (no \"format\": \"{PROFILE_FORMAT}\")")
    if obj.get("version") != PROFILE_VERSION:
        raise ValueError(f"{where} has profile version {obj.get('version')!r}; this kvrelay reads "
                         f"version {PROFILE_VERSION}: profile again with `kvrelay profile`")
    for key in ("model", "engine", "prefill", "decode"):
        if key not in obj:
            raise ValueError(f"{where} lacks the field {key!r}")
    engine = _number_dict(obj["engine"], _ENGINE_KEYS, f"{where}: engine")
    if isinstance(obj["engine"].get("max_model_len"), int):
        engine["max_model_len"] = obj["engine"]["max_model_len"]
    fits = {name: StepFit(**_number_dict(obj[name], _FIT_KEYS, f"{where}: {name}"))
            for name in ("prefill", "decode")}
    transfer = {name: TransferFit(**_number_dict(fit, ("latency_ms", "ms_per_mib"),
                                                 f"{where}: transfer.{name}"))
                for name, fit in (obj.get("transfer") or {}).items()}
    return Profile(model=str(obj["model"]), engine={k: int(v) for k, v in engine.items()},
                   prefill=fits["prefill"], decode=fits["decode"], transfer=transfer,
                   decode_by_batch=_by_batch(obj.get("decode_by_batch") or {}, where),
                   step_time_scale=_positive(obj.get("step_time_scale", 1.0), f"{where}: step_time_scale"),
                   co_run_slowdown=_slowdowns(obj.get("co_run_slowdown") or {}, where),
                   overhead_ms={k: float(v) for k, v in (obj.get("overhead_ms") or {}).items()} or
                   {"request": 0.0, "pd_hop": 0.0},
                   gpus_per_instance=int(obj.get("gpus_per_instance", 1)), dtype=str(obj.get("dtype", "")),
                   threads=obj.get("threads"), created=str(obj.get("created", "")),
                   machine=dict(obj.get("machine") or {}), samples=dict(obj.get("samples") or {}))


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{where} must be a number > 0, got {value!r}")
    return float(value)


def _slowdowns(obj: Any, where: str) -> dict[str, float]:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: co_run_slowdown must be an object {{\"prefill\"|\"decode\": factor}}, "
                         f"got {obj!r}")
    out = {}
    for key, value in obj.items():
        if key not in ("prefill", "decode"):
            raise ValueError(f"{where}: co_run_slowdown has the key {key!r}; "
                             "it takes \"prefill\" and \"decode\"")
        out[key] = _positive(value, f"{where}: co_run_slowdown.{key}")
    return out


def _by_batch(obj: Any, where: str) -> dict[int, float]:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: decode_by_batch must be an object {{batch size: ms}}, got {obj!r}")
    out = {}
    for key, value in obj.items():
        if not str(key).isdigit() or int(key) < 1:
            raise ValueError(f"{where}: decode_by_batch has batch size {key!r}; sizes are integers >= 1")
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError(f"{where}: decode_by_batch.{key} must be a number >= 0, got {value!r}")
        out[int(key)] = float(value)
    return out


def _number_dict(obj: Any, keys: Sequence[str], where: str) -> dict[str, float]:
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be an object with {', '.join(keys)}")
    out = {}
    for key in keys:
        value = obj.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}.{key} must be a number, got {value!r}")
        out[key] = float(value)
    return out


def is_distserve_format(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(
        isinstance(v, dict) and all(isinstance(t, dict) and "prefill" in t for t in v.values())
        for v in obj.values())


def distserve_coeffs(obj: dict[str, Any], model: str | None, tp: int,
                     where: str) -> tuple[str, DistServeCoeffs]:
    if model is None:
        if len(obj) != 1:
            raise ValueError(f"{where} holds several models ({', '.join(obj)}): choose one with --model")
        model = next(iter(obj))
    if model not in obj:
        raise ValueError(f"model {model!r} is not in profile {where}; it has: {', '.join(obj)}")
    by_tp = obj[model]
    if str(tp) not in by_tp:
        raise ValueError(f"{model} in {where} has no entry for tensor parallel size {tp}; "
                         f"it has TP {', '.join(sorted(by_tp, key=int))}")
    entry = by_tp[str(tp)]
    return model, DistServeCoeffs(tuple(entry["prefill"]), tuple(entry["decoding_smallbs"]),  # type: ignore[arg-type]
                                  tuple(entry["decoding_largebs"]),
                                  int(entry.get("decoding_large_small_bs_threshold", 95)))


def distserve_max_tokens(path: Path, model: str, tp: int, pp: int = 1) -> int | None:
    """Token capacity from DistServe's max_num_tokens.csv next to the profile, if present."""
    table = path.parent / "max_num_tokens.csv"
    if not table.is_file():
        return None
    with table.open() as f:
        for row in csv.DictReader(f):
            if row["model"] == model and int(row["tp"]) == tp and int(row["pp"]) == pp:
                return int(row["max_num_tokens"])
    return None


def load_profile(path: str | Path, model: str | None = None, tp: int = 1, block_size: int = 16,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 256) -> Profile:
    """Read a kvrelay profile, or one model and TP size out of a DistServe profile file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"profile {path} does not exist; write one with `kvrelay profile -o {path}`")
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"profile {path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(obj, dict) and "format" in obj:
        profile = profile_from_json(obj, str(path))
        if model is not None and model != profile.model:
            raise ValueError(f"model {model!r} is not in profile {path}; it profiles {profile.model!r}")
        return profile
    if not is_distserve_format(obj):
        raise ValueError(f"profile {path} is neither a kvrelay profile nor DistServe's format "
                         "({model: {tp: {prefill, decoding_smallbs, decoding_largebs}}})")
    name, coeffs = distserve_coeffs(obj, model, tp, str(path))
    max_tokens = distserve_max_tokens(path, name, tp) or 10**7
    engine = {"block_size": block_size, "num_blocks": max_tokens // block_size,
              "kv_bytes_per_token": OPT_KV_BYTES_PER_TOKEN.get(name, 0),
              "max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs}
    return Profile(model=name, engine=engine, distserve=coeffs, gpus_per_instance=tp, dtype="float16",
                   source=f"distserve:{path.name}")

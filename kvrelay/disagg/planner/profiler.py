"""`kvrelay profile`: measure this instance's latency model on this machine.

The profiler builds one engine (the model, dtype, threads and KV memory the instance will run
with), then times engine steps of known shape: prompt batches of T tokens over B sequences after
P cached prefix tokens, and decode steps of B sequences with given contexts. It times KV reads
over each transport that can run here, and records the engine's capacity. Fitting the step model
(`profile.StepFit`) is a least-squares fit on relative error, so short decode steps count as
much as long prefills; a coefficient that comes out negative is dropped and the fit redone.
"""

from __future__ import annotations

import itertools
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvrelay.disagg.planner.profile import Profile, StepFit, TransferFit, kpairs
from kvrelay.disagg.planner.step_timer import StepTimer
from kvrelay.utils import cdiv


@dataclass(frozen=True)
class ProfileGrid:
    prefill_tokens: tuple[int, ...] = (16, 64, 128, 256, 512, 1024, 2048)
    prefill_seqs: tuple[int, ...] = (1, 4)
    prefix_tokens: tuple[int, ...] = (0, 512, 1024)
    decode_batch: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_context: tuple[int, ...] = (64, 256, 1024)
    transfer_tokens: tuple[int, ...] = (16, 256, 1024, 4096)
    reps: int = 3

    def __post_init__(self) -> None:
        for name in ("prefill_tokens", "prefill_seqs", "decode_batch", "decode_context", "transfer_tokens"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"profile grid {name} needs values >= 1, got {list(values)}")
        if min(self.prefix_tokens, default=0) < 0:
            raise ValueError(f"prefix tokens must be >= 0, got {list(self.prefix_tokens)}")
        if self.reps < 1:
            raise ValueError(f"--reps must be >= 1, got {self.reps}")


QUICK_GRID = ProfileGrid(prefill_tokens=(8, 32), prefill_seqs=(1, 2), prefix_tokens=(0, 16),
                         decode_batch=(1, 4), decode_context=(16, 48), transfer_tokens=(16, 64), reps=1)


def decode_batches(wanted: Sequence[int]) -> list[int]:
    """The grid's decode batch sizes plus both sides of every row count at which the engine's
    linear layers change route (kvrelay.model.layers.linear_route_starts), up to the largest size
    asked for: a decode step's cost jumps there, and the profile's per-batch table is
    interpolated between sampled sizes, so each side must be sampled."""
    from kvrelay.model.layers import linear_route_starts

    edges = {b for first in linear_route_starts() if first > 1 for b in (first - 1, first)}
    return sorted(set(wanted) | {b for b in edges if 1 <= b <= max(wanted)})


def decode_table(samples: Sequence[dict[str, Any]], per_kpair_ms: float) -> dict[int, float]:
    """Per batch size: the median over its samples of the step's time less the fit's context
    term (`per_kpair_ms * kpairs`), never below 0."""
    by_batch: dict[int, list[float]] = {}
    for s in samples:
        by_batch.setdefault(int(s["batch_size"]), []).append(s["ms"] - per_kpair_ms * s["kpairs"])
    return {b: max(0.0, statistics.median(v)) for b, v in sorted(by_batch.items())}


# ----------------------------------------------------------------------------- fitting

def fit_step(rows: Sequence[Sequence[float]], times_ms: Sequence[float], use: Sequence[bool]) -> StepFit:
    """Least squares on relative error for t = intercept + tokens*a + seqs*b + kpairs*c, over the
    features switched on in `use` (intercept, tokens, seqs, kpairs); none comes out negative."""
    import numpy as np

    x = np.array([[1.0, *r] for r in rows], dtype=float)
    y = np.array(times_ms, dtype=float)
    active = [i for i, on in enumerate(use) if on]
    coef = np.zeros(4)
    weights = 1.0 / np.maximum(y, 1e-6)
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * weights[:, None], y * weights, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return StepFit(*(float(c) for c in coef))


def fit_transfer(samples: Sequence[tuple[int, float]]) -> TransferFit:
    import numpy as np

    mib = np.array([b / 2**20 for b, _ in samples])
    ms = np.array([t for _, t in samples])
    if len(samples) < 2 or np.ptp(mib) == 0:
        return TransferFit(0.0, float((ms / np.maximum(mib, 1e-9)).mean()))
    slope, intercept = np.polyfit(mib, ms, 1)
    return TransferFit(max(0.0, float(intercept)), max(0.0, float(slope)))


# ----------------------------------------------------------------------------- measuring

def measure_transfer(backend: str, spec: Any, block_size: int, dtype: str, num_tokens: int,
                     reps: int) -> tuple[int, float]:
    """(bytes, best ms) of reading `num_tokens` tokens of KV between two local transports."""
    import torch

    from kvrelay.kv_transfer.transport import TransferState, create_transport
    from kvrelay.worker.model_runner import torch_dtype

    num_blocks = cdiv(num_tokens, block_size)
    shape = (num_blocks, 2, spec.num_kv_heads, block_size, spec.head_dim)  # [blocks, 2, H_kv, bs, D]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(spec.num_layers)]
    src = {n: torch.rand(shape).to(torch_dtype(dtype)) for n in names}
    dst = {n: torch.zeros_like(src[n]) for n in names}
    p, d = create_transport(backend, "profile-p"), create_transport(backend, "profile-d")
    try:
        layout = p.register_kv_caches(src)
        d.register_kv_caches(dst)
        d.add_remote("profile-p", p.agent_metadata(), layout)
        times = []
        for i in range(reps + 1):  # the first read connects: not timed
            start = time.perf_counter()
            handle = d.read_blocks("profile-p", list(range(num_blocks)), list(range(num_blocks)),
                                   f"profile{i}:1".encode())
            while (state := handle.poll()) == TransferState.PENDING:
                time.sleep(0)
            times.append((time.perf_counter() - start) * 1e3)
            handle.release()
            if state != TransferState.DONE:
                raise RuntimeError(f"{backend} read failed while profiling: {handle.error}")
        return layout.block_bytes * num_blocks * len(names), min(times[1:])
    finally:
        d.close()
        p.close()


def available_backends() -> list[str]:
    from kvrelay.kv_transfer.transport import nixl_available
    return ["tcp", *(["nixl"] if nixl_available() else [])]


# ----------------------------------------------------------------------------- the run

def _prefill_cases(grid: ProfileGrid, budget: int) -> list[tuple[list[int], int]]:
    cases = []
    for total in grid.prefill_tokens:
        for seqs in grid.prefill_seqs:
            if total >= seqs and total <= budget:
                cases.append(([total // seqs] * seqs, 0))
    for prefix in grid.prefix_tokens:
        if prefix:
            cases += [([t], prefix) for t in grid.prefill_tokens[:: max(1, len(grid.prefill_tokens) // 3)]]
    return [cases[i] for i in spread_order(len(cases))]


def spread_order(n: int) -> list[int]:
    """0..n-1 so that every prefix spans the range: both ends, then midpoints of the gaps, e.g.
    5 -> [0, 4, 2, 1, 3]."""
    if n <= 0:
        return []
    order, gaps = [0] + ([n - 1] if n > 1 else []), [(0, n - 1)]
    while gaps:
        lo, hi = gaps.pop(0)
        if hi - lo < 2:
            continue
        mid = (lo + hi) // 2
        order.append(mid)
        gaps += [(lo, mid), (mid, hi)]
    return order


def run_profile(engine: Any, grid: ProfileGrid, max_seconds: float, threads: int | None,
                backends: Sequence[str] | None = None, progress: bool = True,
                model_name: str | None = None, co_run: bool = False) -> Profile:
    """Measure the grid on `engine` (stopping early after `max_seconds`), fit, and return the
    profile. With `co_run`, then also how much slower steps get beside a busy neighbour instance
    (`corun.measure_co_run`), unless the deadline has passed."""
    from kvrelay.worker.model_runner import kv_block_bytes

    cfg = engine.config
    budget = cfg.scheduler.max_num_batched_tokens
    timer = StepTimer(engine, cfg.model.seed)
    backends = list(backends) if backends is not None else available_backends()
    prefill_cases = _prefill_cases(grid, budget)
    # NOTE: orders for a run cut short by --max-seconds: every batch size at the first context
    # before any at the second (the per-batch table needs each size), prefill spread over sizes.
    decode_cases = [(b, c) for c in grid.decode_context for b in decode_batches(grid.decode_batch)]
    transfer_cases = [(be, t) for be in backends for t in grid.transfer_tokens]
    jobs: list[tuple[str, Callable[[], None]]] = []
    samples: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": [], "transfer": []}

    def prefill_job(lens: list[int], prefix: int) -> Callable[[], None]:
        def job() -> None:
            # NOTE: the best of the repetitions: on a shared machine noise only ever adds time
            ms = min(timer.prefill_ms(lens, prefix) for _ in range(grid.reps))
            samples["prefill"].append({"batch_tokens": sum(lens), "num_seqs": len(lens),
                                       "prefix_tokens": prefix,
                                       "kpairs": kpairs([(n, prefix) for n in lens]), "ms": ms})
        return job

    def decode_job(batch: int, context: int) -> Callable[[], None]:
        def job() -> None:
            steps = timer.decode_ms(batch, context, grid.reps)
            if steps:
                total, ms = min(steps, key=lambda s: s[1])  # the best step, as for prefill
                samples["decode"].append({"batch_size": batch, "total_context": total,
                                          "kpairs": kpairs([(1, total / batch)] * batch), "ms": ms})
        return job

    def transfer_job(backend: str, tokens: int) -> Callable[[], None]:
        def job() -> None:
            nbytes, ms = measure_transfer(backend, engine.spec, cfg.cache.block_size, cfg.model.dtype,
                                          tokens, grid.reps)
            samples["transfer"].append({"backend": backend, "bytes": nbytes, "ms": ms})
        return job

    timer.prefill_ms([8], 0)  # warm-up (lazy initialisation, first native kernel build): not kept
    timer.decode_ms(1, 8, 1)
    # NOTE: the kinds take turns, so a run cut short by --max-seconds still has some of each.
    by_kind = [[("prefill", prefill_job(*c)) for c in prefill_cases],
               [("decode", decode_job(*c)) for c in decode_cases],
               [("transfer", transfer_job(*c)) for c in transfer_cases]]
    jobs += [job for turn in itertools.zip_longest(*by_kind) for job in turn if job is not None]
    deadline = time.monotonic() + max_seconds
    _run_jobs(jobs, deadline, f"--max-seconds {max_seconds:g}", progress)
    profile = _build_profile(engine, samples, threads, model_name, kv_block_bytes)
    if co_run:
        profile.co_run_slowdown, samples["co_run"] = _co_run(engine, timer, grid, profile.threads or 1,
                                                             deadline, progress)
    return profile


def _run_jobs(jobs: Sequence[tuple[str, Callable[[], None]]], deadline: float, limit: str,
              progress: bool) -> None:
    """Run the measurement jobs in order until the deadline (`limit` names it in the message)."""
    from tqdm.auto import tqdm

    bar = tqdm(jobs, desc="profiling", unit="case", disable=not progress)
    for kind, job in bar:
        if time.monotonic() > deadline:
            bar.write(f"profile: {limit} reached; fitting what was measured")
            break
        bar.set_postfix_str(kind)
        job()
    bar.close()


def _co_run(engine: Any, timer: StepTimer, grid: ProfileGrid, threads: int, deadline: float,
            progress: bool) -> tuple[dict[str, float], list[dict[str, Any]]]:
    from tqdm.auto import tqdm

    from kvrelay.disagg.planner import corun

    if time.monotonic() > deadline:
        print("profile: --max-seconds reached before the co-run cases; the profile has no "
              "co_run_slowdown", flush=True)
        return {}, []

    cases = corun.pick_cases(grid.prefill_tokens, decode_batches(grid.decode_batch), grid.decode_context,
                             engine.config.scheduler.max_num_batched_tokens, grid.reps)
    config = corun.neighbour_config(engine, threads)
    with tqdm(total=2, desc="co-run", unit="phase", disable=not progress) as bar:
        started: list[str] = []

        def phase(what: str) -> None:
            bar.update(1 if started else 0)
            started.append(what)
            bar.set_postfix_str(what)
        try:
            slowdown, samples = corun.measure_co_run(timer, cases, lambda kind: corun.Neighbour(config, kind),
                                                     phase)
        except RuntimeError as exc:  # NOTE: the profile stays usable without it
            print(f"profile: no co-run measurement: {exc}", flush=True)
            return {}, []
        bar.update(1)
    print(f"profile: {corun.describe(slowdown)}", flush=True)
    return slowdown, samples


def _build_profile(engine: Any, samples: dict[str, list[dict[str, Any]]], threads: int | None,
                   model_name: str | None, kv_block_bytes: Callable[..., int]) -> Profile:
    import torch

    if len(samples["prefill"]) < 2 or len(samples["decode"]) < 2:
        raise ValueError(f"too few samples to fit ({len(samples['prefill'])} prefill, "
                         f"{len(samples['decode'])} decode): raise --max-seconds or shrink the grid")
    pre = samples["prefill"]
    prefill = fit_step([(s["batch_tokens"], s["num_seqs"], s["kpairs"]) for s in pre], [s["ms"] for s in pre],
                       (True, True, True, True))
    dec = samples["decode"]
    decode = fit_step([(s["batch_size"], 0, s["kpairs"]) for s in dec], [s["ms"] for s in dec],
                      (True, True, False, True))
    transfer = {}
    for backend in sorted({s["backend"] for s in samples["transfer"]}):
        transfer[backend] = fit_transfer([(s["bytes"], s["ms"]) for s in samples["transfer"]
                                          if s["backend"] == backend])
    cfg = engine.config
    bs = cfg.cache.block_size
    return Profile(
        model=model_name or engine.model_name,
        engine={"block_size": bs, "num_blocks": engine.num_blocks,
                "kv_bytes_per_token": kv_block_bytes(engine.spec, bs, engine.kv.format.name) // bs,
                "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
                "max_num_seqs": cfg.scheduler.max_num_seqs, "max_model_len": engine.max_model_len},
        prefill=prefill, decode=decode, transfer=transfer, dtype=cfg.model.dtype,
        decode_by_batch=decode_table(dec, decode.per_kpair_ms),
        threads=threads or torch.get_num_threads(),
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        machine={"hostname": platform.node(), "cpus": available_cpus(), "torch": torch.__version__,
                 "processor": platform.processor()},
        samples=samples)


def available_cpus() -> int:
    import os
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1

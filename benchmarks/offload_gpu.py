"""Offload from GPU KV (issue 33's targets) on one instance: random weights of SmolLM2-135M's
shape, bf16, CUDA graphs, an OffloadConnector with a CPU tier.

    repeat   4096-token prompts run cold (their chunks are stored meanwhile), then again after the
             GPU prefix cache is reset: the prompt tokens each repeat computed (target: 1; the rest
             is loaded from the CPU tier) and both TTFTs
    stores   decode ITL of one request beside a stream of 512-token prefills whose chunks are
             stored, against the same workload with the copy-out switched off, alternated three
             times each (target: stores on <= +10%)
    loads    decode ITL of one request while repeated 4096-token prompts are loaded from the tier
             one after another (each computes one token), against the request decoding alone
             (target: <= +10%)

    python benchmarks/offload_gpu.py [--device cuda] [--decode-tokens 64] [--prompt-tokens 4096]

`--device cpu` runs the same code on the CPU (a dry run, not a GPU figure; add a small
`--prompt-tokens`). Prints one table.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

import model_shapes  # benchmarks/model_shapes.py
from bench_offload import (
    CHUNK_TOKENS,
    close,
    decode_itl_beside,
    decode_itl_beside_prefills,
    drain,
    ttft_computing,
)
from gpu_measure import kvrelay_llm

from kvrelay import LLM

NUM_REPEATS = 4


def offload_gpu_llm(device: str, prompt_tokens: int) -> LLM:
    config = model_shapes.shape_config("smollm2-135m")
    weights = model_shapes.random_weights(config, seed=0, device=device)
    loaded = model_shapes.loaded_model(config, weights, "smollm2-135m-random")
    transfer = {"kv_connector": "OffloadConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"chunk_tokens": CHUNK_TOKENS, "max_pending_stores": 32,
                                              "cpu_bytes": "4GiB"}}
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return kvrelay_llm(loaded, device, dtype, "2GiB", seed=0, kv_transfer_config=transfer,
                       max_model_len=max(4096, prompt_tokens + 256))


def run(device: str, decode_tokens: int, prompt_tokens: int) -> list[tuple[str, str, str]]:
    llm = offload_gpu_llm(device, prompt_tokens)
    rows: list[tuple[str, str, str]] = []
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(prompt_tokens)] for _ in range(2 * NUM_REPEATS + 1)]
    try:
        ttft_computing(llm, prompts[-1])  # warm-up: the graphs, the tier's buffers
        cold, warm, computed = [], [], []
        for prompt in prompts[:NUM_REPEATS]:
            seconds, _ = ttft_computing(llm, prompt)
            cold.append(seconds)
            drain(llm)  # every chunk written before the repeat asks for it
            llm.engine.scheduler.reset_prefix_cache()
            seconds, tokens = ttft_computing(llm, prompt)
            warm.append(seconds)
            computed.append(tokens)
            llm.engine.scheduler.reset_prefix_cache()
        rows.append(("repeat: prompt tokens computed per repeat (target 1)", ", ".join(map(str, computed)),
                     "met" if all(c == 1 for c in computed) else "NOT met"))
        rows.append(("repeat: TTFT cold / warm, median ms",
                     f"{statistics.median(cold) * 1e3:.1f} / {statistics.median(warm) * 1e3:.1f}", ""))

        runs: dict[bool, list[float]] = {False: [], True: []}
        for i, stores_on in enumerate((False, True, True, False, False, True)):
            runs[stores_on].append(decode_itl_beside_prefills(llm, decode_tokens, stores_on, seed=100 + i)[0])
        off, on = statistics.mean(runs[False]), statistics.mean(runs[True])
        rows.append(("stores: decode ITL beside prefills, copy-out off / on, ms",
                     f"{off * 1e3:.2f} / {on * 1e3:.2f} ({on / off - 1:+.1%})",
                     "met" if on <= 1.1 * off else "NOT met"))

        loaded = prompts[NUM_REPEATS:2 * NUM_REPEATS]
        for prompt in loaded:  # into the tier, then out of the GPU prefix cache
            ttft_computing(llm, prompt)
        drain(llm)
        llm.engine.scheduler.reset_prefix_cache()
        decode_prompt = [random.Random(7).randrange(100, 40000) for _ in range(100)]
        alone = decode_itl_beside(llm.engine, decode_tokens, decode_prompt, lambda: None)
        beside = decode_itl_beside(llm.engine, decode_tokens, decode_prompt,
                                   lambda: loaded.pop() if loaded else None)
        llm.engine.run_until_idle(timeout_s=600)
        rows.append(("loads: decode ITL alone / beside repeated prompts loaded, ms",
                     f"{alone * 1e3:.2f} / {beside * 1e3:.2f} ({beside / alone - 1:+.1%})",
                     "met" if beside <= 1.1 * alone else "NOT met"))
    finally:
        close(llm)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    args = parser.parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("offload_gpu: no CUDA device visible; nothing measured (--device cpu is a dry run)")
        return 1
    rows = run(args.device, args.decode_tokens, args.prompt_tokens)
    print(f"Offload from KV on {args.device} (SmolLM2-135M shape, random weights, CPU tier, "
          f"{args.prompt_tokens}-token prompts)\n")
    print("| measure | value | target |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

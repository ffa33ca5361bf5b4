"""What each CPU fast path buys inside a real decode step (SmolLM2-135M fp32, 2 threads).

    .venv/bin/python benchmarks/bench_kernels.py [--batches 1 16 64] [--steps 30]

For each batch size, one engine decodes that many requests (256-token prompts) and the measured
steps alternate between the fast path and its plain-torch baseline, step by step, so both sides
see the same machine state (on a shared VM, separate runs drift by 10% and more):

  attention    kvrelay/kernels/paged_decode.c (blocks read in place) against the torch route
               (gather the blocks into a padded copy, then batched matmuls);
  linear       kvrelay.model.layers.linear (kvrelay/kernels/linear.c for 1-512 rows) against F.linear;
  elementwise  kvrelay/kernels/elementwise.c (add + RMSNorm, SiLU-mul, rotary, KV write) against
               the torch operators;
  all          every native path at once (KVRELAY_NATIVE_KERNELS=1) against none (=0).

Prints the median step time of each side and the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_offline import decoding_engine, stop_all  # noqa: E402
from hostinfo import cpu_summary  # noqa: E402

import kvrelay.attention.layer as attention  # noqa: E402
import kvrelay.kernels.native as native  # noqa: E402
import kvrelay.model.layers as layers  # noqa: E402


def set_attention(fast: bool) -> None:
    attention.paged_decode_kernel = native.paged_decode_kernel if fast else (lambda: None)


_ROW_SPLIT_MAX_TOKENS = layers._ROW_SPLIT_MAX_TOKENS  # kvrelay's own settings
_NATIVE_MIN_TOKENS = layers._NATIVE_MIN_TOKENS


def set_linear(fast: bool) -> None:
    layers._ROW_SPLIT_MAX_TOKENS = _ROW_SPLIT_MAX_TOKENS if fast else 0
    layers._NATIVE_MIN_TOKENS = _NATIVE_MIN_TOKENS if fast else sys.maxsize


def set_elementwise(fast: bool) -> None:
    getter = native.elementwise_kernels if fast else (lambda: None)
    layers.elementwise_kernels = attention.elementwise_kernels = getter


def set_all(fast: bool) -> None:
    os.environ["KVRELAY_NATIVE_KERNELS"] = "1" if fast else "0"  # read on every call


def alternate(batch: int, steps: int, toggle: Callable[[bool], None]) -> tuple[float, float]:
    """Median step seconds with the fast path off and on, alternating every step."""
    engine = decoding_engine(batch, prompt_len=256, decode_steps=steps)
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for k in range(steps):
            fast = k % 2 == 1
            toggle(fast)
            start = time.perf_counter()
            outs = engine.step()
            times[fast].append(time.perf_counter() - start)
            assert len(outs) == batch, "every request must decode in the measured steps"
    finally:
        toggle(True)
        stop_all(engine, batch)
    return statistics.median(times[False]), statistics.median(times[True])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name, toggle, baseline in (("attention", set_attention, "torch gather"),
                                   ("linear", set_linear, "F.linear"),
                                   ("elementwise", set_elementwise, "torch ops"),
                                   ("all", set_all, "plain torch")):
        for batch in args.batches:
            off, on = alternate(batch, args.steps, toggle)
            rows.append((name, batch, baseline, off, on))
            print(f"  {name} batch {batch}: {baseline} {off * 1e3:.1f} ms, fast path {on * 1e3:.1f} ms",
                  flush=True)
    print(f"\ndecode step time, fast path against its baseline, alternating steps ({args.threads} threads)")
    print(cpu_summary())
    print(f"{'path':<12} {'batch':>5} {'baseline':>13} {'base ms':>8} {'fast ms':>8} {'speed-up':>8}")
    for name, batch, baseline, off, on in rows:
        print(f"{name:<12} {batch:>5} {baseline:>13} {off * 1e3:>8.1f} {on * 1e3:>8.1f} {off / on:>7.2f}x")


if __name__ == "__main__":
    main()

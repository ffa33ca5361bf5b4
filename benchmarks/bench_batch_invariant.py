"""What the batch-invariant mode costs, and that it costs nothing when off, in one run.

    python benchmarks/bench_batch_invariant.py              # the default model, 3 rounds
    python benchmarks/bench_batch_invariant.py --quick      # one round, one repetition, half the tokens

Three engines run the same workloads:
  baseline    the code before the mode (`--baseline-rev`, exported with git archive; the mode
              does not exist there), in a child process of its own;
  mode off    this tree, without --batch-invariant;
  mode on     this tree, with it; mode off and mode on live in one child process and take turns
              workload by workload, so that the load of a shared machine falls on both alike.
The two children alternate round by round (`--rounds`), each running every workload
`--repeats` times. Workloads (the default model, SmolLM2-135M fp32, greedy, ignore_eos, fixed
seeds; offline: every request added at once, the engine stepped until done; a warm-up first):
  single      one request, a 128-token prompt, 64 tokens out: decode tok/s after the first token,
              and TTFT;
  batch 32    32 requests of 128-token prompts, 32 tokens out: tokens per second (prompt + output)
              and mean TTFT;
  mixed       4 long prompts (1024 tokens) among 28 short ones (32-128 tokens), 16-64 tokens out:
              tokens per second (prompt + output) and mean TTFT (the long prefills share steps with
              the short requests' decodes: the steps of more than 128 rows, where the default path
              leaves the native kernel, and prefill attention, which the mode runs row by row).
Each cell is the median over every run with the range (min-max) beside it; the ratios compare
medians: mode off / baseline (target 1.00 within the ranges) and mode on / mode off (target on
the mixed workload: at most 25% slower, i.e. tokens per second >= 0.80x). `--clock cpu` counts
the process's CPU time instead of wall time: on a machine shared with other jobs wall time
measures the neighbours as much as the engine (with `--threads 1`, so that no thread spins
waiting for a descheduled one).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BASELINE_REV = "459b809"  # main before the batch-invariant mode (issue 40)
WORKLOADS = ("single", "batch32", "mixed")


# ----------------------------------------------------------------------------- child: one engine
def workload_prompts(name: str, quick: bool) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per request of workload `name` (fixed seeds)."""
    rng = random.Random(WORKLOADS.index(name))
    scale = 2 if quick else 1

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(max(1, n // scale))]

    if name == "single":
        return [(tokens(128), 64 // scale)]
    if name == "batch32":
        return [(tokens(128), 32 // scale) for _ in range(32)]
    requests = [(tokens(rng.randrange(32, 129)), rng.randrange(16, 65) // scale) for _ in range(28)]
    for place in (0, 9, 17, 25):
        requests.insert(place, (tokens(1024), rng.randrange(16, 65) // scale))
    return requests


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def run_workload(engine: Any, requests: list[tuple[list[int], int]], tag: str) -> dict[str, Any]:
    """Add every request, step until all are done; per clock: the time taken and each request's
    time to its first token (from the start)."""
    from kvrelay import SamplingParams

    start = {name: clock() for name, clock in CLOCKS.items()}
    for i, (prompt, max_tokens) in enumerate(requests):
        engine.add_request({"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           request_id=f"{tag}-{i}")
    first: dict[str, dict[str, float]] = {}
    output_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = {name: clock() - start[name] for name, clock in CLOCKS.items()}
            if out.finished:
                output_tokens += len(out.outputs[0].token_ids)
    took = {name: clock() - start[name] for name, clock in CLOCKS.items()}
    engine.run_until_idle()
    ids = [f"{tag}-{i}" for i in range(len(requests))]
    return {"took_s": took, "ttft_s": {name: [first[rid][name] for rid in ids] for name in CLOCKS},
            "prompt_tokens": sum(len(p) for p, _ in requests), "output_tokens": output_tokens}


def child(modes: list[str], repeats: int, quick: bool, threads: int | None, out: Path) -> None:
    """Every workload `repeats` times on one engine per mode ("off", "on"), the modes taking
    turns; writes each run's numbers."""
    import torch

    import kvrelay
    from kvrelay import LLM

    if threads is not None:
        torch.set_num_threads(threads)
    engines = {}
    for mode in modes:  # NOTE: the baseline's LLM has no batch_invariant argument
        engines[mode] = LLM(**({"batch_invariant": True} if mode == "on" else {})).engine
        run_workload(engines[mode], [(list(range(100, 164)), 8)], "warmup")
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for repeat in range(repeats):
        for name in WORKLOADS:
            for mode in modes if repeat % 2 == 0 else modes[::-1]:
                result = run_workload(engines[mode], workload_prompts(name, quick), f"{name}-{repeat}")
                runs[mode].append({"workload": name, **result})
    out.write_text(json.dumps({"kvrelay": str(Path(kvrelay.__file__).resolve().parent.parent),
                               "threads": torch.get_num_threads(), "runs": runs}))


# ----------------------------------------------------------------------------- parent: the table
def export_baseline(rev: str, dest: Path) -> str:
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--short", f"{rev}^{{commit}}"],
                            capture_output=True, text=True, check=True).stdout.strip()
    archive = dest / "tree.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), commit], check=True)
    subprocess.run(["tar", "-x", "-f", str(archive), "-C", str(dest)], check=True)
    archive.unlink()
    return commit


def run_child(tree: Path, modes: list[str], repeats: int, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("KVRELAY_BATCH_INVARIANT", None)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *modes, "--repeats", str(repeats),
               "--json", str(out), *(["--quick"] if args.quick else []),
               *(["--threads", str(args.threads)] if args.threads else [])]
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                              timeout=args.child_timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"the child against {tree} exited with {proc.returncode}:\n"
                               f"{proc.stderr[-3000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
    if Path(result["kvrelay"]).resolve() != tree.resolve():
        raise RuntimeError(f"the child imported kvrelay from {result['kvrelay']}, not {tree}")
    return result


METRICS = ("single: decode tok/s", "single: TTFT ms", "batch 32: tok/s", "batch 32: mean TTFT ms",
           "mixed: tok/s", "mixed: mean TTFT ms")


def metrics(run: dict[str, Any], clock: str) -> dict[str, float]:
    """The table's numbers of one workload run, by `clock` ("wall" or "cpu")."""
    took, ttft = run["took_s"][clock], run["ttft_s"][clock]
    if run["workload"] == "single":
        return {"single: decode tok/s": (run["output_tokens"] - 1) / (took - ttft[0]),
                "single: TTFT ms": 1000 * ttft[0]}
    label = "batch 32" if run["workload"] == "batch32" else "mixed"
    return {f"{label}: tok/s": (run["prompt_tokens"] + run["output_tokens"]) / took,
            f"{label}: mean TTFT ms": 1000 * statistics.mean(ttft)}


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def table(samples: dict[str, dict[str, list[float]]], baseline: str) -> str:
    rows = [f"| metric | {baseline} | mode off | mode on | off / baseline | on / off |",
            "|---|---|---|---|---|---|"]
    for name in METRICS:
        values = {label: samples[label].get(name, []) for label in ("baseline", "mode off", "mode on")}
        if not all(values.values()):
            continue
        med = {label: statistics.median(v) for label, v in values.items()}
        rows.append(f"| {name} | {cell(values['baseline'])} | {cell(values['mode off'])} | "
                    f"{cell(values['mode on'])} | {med['mode off'] / med['baseline']:.3f} | "
                    f"{med['mode on'] / med['mode off']:.3f} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds over the two children (default 3, quick 1)")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs of every workload per child and round (default 2, quick 1)")
    p.add_argument("--quick", action="store_true", help="one round, one run, half the tokens")
    p.add_argument("--baseline-rev", default=BASELINE_REV,
                   help=f"the code before the mode (default {BASELINE_REV})")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of every engine (default: torch's)")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                   help="wall: seconds as a user sees them; cpu: the process's CPU seconds, steadier on a "
                        "shared machine (with --threads 1, where no thread spins waiting for another)")
    p.add_argument("--child-timeout", type=float, default=1800.0)
    p.add_argument("--child", nargs="+", choices=("on", "off"), help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    repeats = args.repeats or (1 if args.quick else 2)
    if args.child:
        child(args.child, repeats, args.quick, args.threads, args.json)
        return 0
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from hostinfo import cpu_summary

    rounds = args.rounds or (1 if args.quick else 3)
    samples: dict[str, dict[str, list[float]]] = {"baseline": {}, "mode off": {}, "mode on": {}}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="kvrelay-baseline-") as tmp:
        commit = export_baseline(args.baseline_rev, Path(tmp))
        children = [(Path(tmp), ["off"], {"off": "baseline"}),
                    (ROOT, ["off", "on"], {"off": "mode off", "on": "mode on"})]
        for index in range(rounds):
            for tree, modes, labels in children if index % 2 == 0 else children[::-1]:
                print(f"round {index + 1}/{rounds}: {', '.join(labels.values())} ...", file=sys.stderr,
                      flush=True)
                result = run_child(tree, modes, repeats, args)
                for mode, runs in result["runs"].items():
                    for run in runs:
                        for name, value in metrics(run, args.clock).items():
                            samples[labels[mode]].setdefault(name, []).append(value)
                load.append(os.getloadavg()[0])
    options = "".join(f" --{name} {value}" for name, value in (
        ("rounds", args.rounds), ("repeats", args.repeats), ("threads", args.threads),
        ("clock", args.clock if args.clock != "wall" else None)) if value)
    options = (" --quick" if args.quick else "") + options
    print(f"`python benchmarks/bench_batch_invariant.py{options}`: {rounds} round(s) x {repeats} run(s) per "
          f"engine, {time.strftime('%Y-%m-%d')}, load average {min(load):.1f}-{max(load):.1f}\n")
    print(f"machine: {cpu_summary()}\n")
    if args.clock == "cpu":
        print("Times and rates in the process's CPU seconds (tok/s: per CPU-second; TTFT: CPU ms).\n")
    print(table(samples, f"baseline {commit}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

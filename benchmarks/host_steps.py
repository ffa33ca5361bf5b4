"""Host time per decode step with a near-zero model: what the engine itself costs per step (the
model's arithmetic is a few bytes, benchmarks/model_shapes.py NEAR_ZERO), for the working tree
and a baseline revision in one run.

    PYTHONPATH=TREE python benchmarks/host_steps.py --device cpu --batches 1 64 --steps 200

The measuring half (`measure`, the script's main) runs in a child process whose PYTHONPATH
starts with the tree it measures, so the same code measures both trees. It uses only what
kvrelay offered before the GPU work: LLM(loaded_model=..., num_blocks=..., block_size=...,
device=..., dtype=...), engine.add_request / step / abort_request / run_until_idle,
SamplingParams(max_tokens, temperature, ignore_eos). The comparing half (`host_section`, used by
bench_gpu.py) exports the baseline with git archive, runs the children alternately over several
rounds (so drift in the machine's speed falls on both trees alike) and builds the table.

For each batch size: `batch` greedy requests (8-token prompts) are prefilled, `warmup` steps run,
then each of `steps` decode steps is timed with the host clock around `engine.step()`. A step
returns the sampled tokens to the host, so on a GPU it includes waiting for the device (next to
nothing for this model). torch runs one thread: the model has nothing to share out, and on a
busy machine a second thread waiting for a core would be what is measured (seen on the 2-core VM:
medians 10x apart between runs minutes apart with two threads, within 1.5x with one).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_report import Failure, Section, Table

ROOT = Path(__file__).resolve().parent.parent
PROMPT_LEN = 8
BLOCK_SIZE = 16


def prompt(request_index: int, vocab_size: int) -> list[int]:
    """Distinct prompts (no prefix-cache hits between requests); token 0 (eos) never appears."""
    return [1 + (request_index * 7 + j * 13) % (vocab_size - 1) for j in range(PROMPT_LEN)]


def step_times(engine: Any, batch: int, steps: int, warmup: int) -> list[float]:
    """Seconds of each of `steps` pure decode steps with `batch` requests running."""
    from kvrelay import SamplingParams

    params = SamplingParams(max_tokens=warmup + steps + 2, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": prompt(i, engine.spec.vocab_size)}, params,
                              request_id=f"b{batch}-r{i}") for i in range(batch)]
    started: set[str] = set()
    while len(started) < batch:  # every prefill (one step when the prompts fit a step's budget)
        started.update(o.request_id for o in engine.step())
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.abort_request(ids)
    engine.run_until_idle()
    return times


def measure(device: str, batches: list[int], steps: int, warmup: int) -> dict[str, Any]:
    """{"kvrelay": where it was imported from, "device", "batches": {batch: [seconds, ...]}}."""
    import torch
    from model_shapes import near_zero_loaded_model

    import kvrelay
    from kvrelay import LLM
    from kvrelay.utils import cdiv

    # NOTE: one torch thread: a near-zero model has nothing to share out, and on a busy machine a
    # second thread waiting for a core would be measured instead of the engine's host work.
    torch.set_num_threads(1)
    per_request_blocks = cdiv(PROMPT_LEN + warmup + steps + 2, BLOCK_SIZE)
    num_blocks = per_request_blocks * max(batches) + 16
    llm = LLM(loaded_model=near_zero_loaded_model(), dtype="float32", device=device,
              block_size=BLOCK_SIZE, num_blocks=num_blocks, max_num_seqs=max(batches),
              max_num_batched_tokens=max(2048, PROMPT_LEN * max(batches)))
    try:
        samples = {str(batch): step_times(llm.engine, batch, steps, warmup) for batch in batches}
    finally:
        llm.shutdown()
    return {"kvrelay": str(Path(kvrelay.__file__).resolve().parent.parent), "device": device,
            "batches": samples}


# ----------------------------------------------------------------------------- comparing trees
@dataclass(frozen=True)
class HostPlan:
    batches: tuple[int, ...] = (1, 64)
    steps: int = 200  # timed steps per batch and round
    warmup: int = 20
    rounds: int = 2  # over the trees, alternating their order
    child_timeout_s: float = 120.0


@dataclass(frozen=True)
class Tree:
    label: str
    root: Path


def export_tree(rev: str, dest: Path) -> Tree:
    """`rev` of this repository, exported with git archive into `dest` (no worktree is touched)."""
    found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--short", f"{rev}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise ValueError(f"--baseline-rev {rev!r} is not a commit of {ROOT}: {found.stderr.strip()}")
    commit = found.stdout.strip()
    archive = dest / "tree.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), commit], check=True)
    subprocess.run(["tar", "-x", "-f", str(archive), "-C", str(dest)], check=True)
    archive.unlink()
    return Tree(f"baseline {commit}", dest)


def unpack_tree(archive: Path, dest: Path) -> Tree:
    """A tree carried as `git archive` output (where there is no git repository, as on a lent
    GPU); named after the archive: baseline-71509ca.tar.gz is "baseline 71509ca"."""
    if not archive.is_file():
        raise FileNotFoundError(f"baseline archive {archive} does not exist")
    subprocess.run(["tar", "-x", "-f", str(archive), "-C", str(dest)], check=True)
    name = archive.name.split(".tar")[0]
    return Tree(name.replace("baseline-", "baseline ", 1) if name.startswith("baseline-") else
                f"baseline {name}", dest)


def run_child(tree: Tree, devices: list[str], plan: HostPlan) -> list[dict[str, Any]]:
    """benchmarks/host_steps.py (this tree's) against `tree`'s kvrelay, in a child process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree.root), env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "samples.json"
        cmd = [sys.executable, str(ROOT / "benchmarks" / "host_steps.py"), "--device", *devices,
               "--batches", *map(str, plan.batches), "--steps", str(plan.steps),
               "--warmup", str(plan.warmup), "--json", str(out)]
        proc = subprocess.run(cmd, cwd=tree.root, env=env, capture_output=True, text=True,
                              timeout=plan.child_timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"host_steps.py against {tree.label} exited with {proc.returncode}:\n"
                               f"{proc.stderr[-3000:]}")
        results: list[dict[str, Any]] = json.loads(out.read_text())
    for entry in results:  # the child must have imported the tree it was pointed at
        if Path(entry["kvrelay"]).resolve() != tree.root.resolve():
            raise RuntimeError(f"the child for {tree.label} imported kvrelay from {entry['kvrelay']}, "
                               f"not {tree.root}")
    return results


def host_section(source: str | Path | None, devices: list[str], plan: HostPlan, section: Section) -> None:
    """The working tree against the baseline `source` (a git revision, a Path to a git archive
    of one, or None: the working tree alone) on each device."""
    trees = [Tree("working tree", ROOT)]
    with tempfile.TemporaryDirectory(prefix="kvrelay-baseline-") as tmp:
        if source is not None:
            dest = Path(tmp)
            baseline = section.attempt(f"baseline {source}", lambda: (
                unpack_tree(source, dest) if isinstance(source, Path) else export_tree(source, dest)))
            if not isinstance(baseline, Failure):
                trees.append(baseline)
        samples: dict[tuple[str, str, str], list[float]] = {}
        failed: dict[str, Failure] = {}
        try:
            for round_index in range(plan.rounds):
                for tree in trees if round_index % 2 == 0 else trees[::-1]:
                    result = section.attempt(f"{tree.label}, round {round_index + 1}/{plan.rounds}",
                                             functools.partial(run_child, tree, devices, plan))
                    if isinstance(result, Failure):
                        failed[tree.label] = result
                        continue
                    for entry in result:
                        for batch, times in entry["batches"].items():
                            samples.setdefault((tree.label, entry["device"], batch), []).extend(times)
        finally:  # an interrupted run still shows the rounds it finished
            section.tables.append(host_table(trees, devices, plan, samples, failed))


def host_table(trees: list[Tree], devices: list[str], plan: HostPlan,
               samples: dict[tuple[str, str, str], list[float]], failed: dict[str, Failure]) -> Table:
    current, baseline = trees[0], (trees[1] if len(trees) > 1 else None)
    headers = ["device", "batch", f"{baseline.label if baseline else 'baseline'} ms (median / p90 / min)",
               "working tree ms (median / p90 / min)", "working / baseline (median)"]
    table = Table("Host time per decode step, near-zero model (lower is better)", headers)

    def cell(tree: Tree | None, device: str, batch: str) -> tuple[str, float | None]:
        if tree is None:
            return "not measured (no baseline)", None
        times = samples.get((tree.label, device, batch))
        if not times:
            return str(failed.get(tree.label, Failure(tree.label, "no samples"))), None
        median, p90 = statistics.median(times), percentile(times, 0.9)
        return f"{1e3 * median:.3f} / {1e3 * p90:.3f} / {1e3 * min(times):.3f}", median

    for device in devices:
        for batch in map(str, plan.batches):
            base_text, base = cell(baseline, device, batch)
            cur_text, cur = cell(current, device, batch)
            ratio = f"{cur / base:.2f}x" if cur is not None and base is not None else "-"
            table.rows.append([device, batch, base_text, cur_text, ratio])
    table.notes.append(f"{plan.steps} timed steps per batch and round ({plan.warmup} warm-up), "
                       f"{plan.rounds} round(s) alternating the trees; each tree in its own child process; "
                       "model: hidden 8, 1 layer, 2 heads, vocab 64, float32; one torch thread.")
    return table


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", nargs="+", default=["cpu"], help="one or more devices, e.g. cpu cuda")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--json", type=Path, default=None, help="write the samples here (default: stdout)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or min(args.batches) < 1:
        p.error(f"--steps >= 1, --warmup >= 0 and batches >= 1, got {args.steps}, {args.warmup}, "
                f"{args.batches}")
    results = [measure(device, args.batches, args.steps, args.warmup) for device in args.device]
    text = json.dumps(results)
    if args.json is not None:
        args.json.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

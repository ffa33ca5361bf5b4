"""kvrelay on a GPU against transformers on the same GPU, and the host time per step before and
after, in one run (issue 32's tables).

    python benchmarks/bench_gpu.py                       # every section (CUDA; about 4 minutes on an H200)
    python benchmarks/bench_gpu.py --quick               # a smoke run: SmolLM2 shape, few steps
    python benchmarks/bench_gpu.py --host-only           # the host section alone, anywhere (CPU too)
    python benchmarks/bench_gpu.py --only busy correctness --json results.json

Sections:
  host        host time per decode step (median, p90) at batch 1 and 64 with a near-zero model, for
              the working tree and a baseline revision (`--baseline-rev`, exported with git
              archive), each measured by benchmarks/host_steps.py in a child process whose
              PYTHONPATH is that tree, alternating trees over `--rounds`; cpu, plus the GPU when
              the run has one;
  throughput  for each shape (benchmarks/model_shapes.py: SmolLM2-135M, Llama-3.2-1B; random
              weights, bf16): single-stream decode, batch-64 decode (pure decode steps only) and
              the prefill of a 2048-token prompt, kvrelay (CUDA graphs on) against transformers
              (a greedy loop over its forward with the default dynamic cache, sdpa attention, eager)
              holding the same tensors;
  busy        the GPU's busy share of kvrelay's decode wall time (torch.profiler, CUDA activity:
              the union of kernel, copy and memset intervals over the host time of the steps), with
              kernels per step;
  correctness greedy float32 tokens of kvrelay (the triton route, and the torch route beside it to
              localize a difference) against transformers on 8 prompts of a 4-layer SmolLM2-shaped
              model, and CUDA-graph against eager (`enforce_eager=True`) tokens in bf16.

A failed measurement prints its traceback and leaves "FAILED: ..." in its cell; the others still
run. The tables print at the end (also when stopped by SIGTERM) under the command and the machine,
with a summary of issue 32's targets; `--json` / `--markdown PATH` write them as well.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_measure as measure  # noqa: E402
import model_shapes  # noqa: E402
from gpu_correctness import correctness_section  # noqa: E402
from gpu_report import Failure, Section, Table, free_device_memory, machine_lines  # noqa: E402
from host_steps import HostPlan, host_section  # noqa: E402

SECTIONS = ("host", "throughput", "busy", "correctness")
GPU_SECTIONS = ("throughput", "busy", "correctness")
# NOTE: the last commit before the GPU engine work of issue 32 (the Triton kernels commit only
# added kernels the engine did not call yet). Any revision works: --baseline-rev REV.
BASELINE_REV = "71509ca"


@dataclass(frozen=True)
class Targets:
    """Issue 32's targets for one shape (bf16 on the GPU)."""

    single_tok_s: float
    batch_tok_s: float
    prefill_ratio: float | None  # kvrelay / transformers; None: no target


TARGETS = {"smollm2-135m": Targets(500, 20_000, None), "llama-3.2-1b": Targets(400, 15_000, 1.0)}
BUSY_TARGET = 0.85


@dataclass(frozen=True)
class Plan:
    """Step counts, sized so that the whole CUDA run fits in about 4 minutes on an H200."""

    shapes: tuple[str, ...] = ("smollm2-135m", "llama-3.2-1b")
    dtype: str = "bfloat16"  # of the throughput and busy engines
    batch: int = 64
    single_prompt_len: int = 32
    batch_prompt_len: int = 16
    single_tokens: int = 256
    batch_steps: int = 128
    decode_warmup: int = 8
    prefill_tokens: int = 2048
    prefill_reps: int = 5
    hf_single_tokens: int = 64
    hf_batch_steps: int = 32
    busy_batches: tuple[int, ...] = (1, 64)
    busy_steps: int = 32
    correctness_prompts: int = 8
    correctness_tokens: int = 32
    host: HostPlan = HostPlan()


QUICK = Plan(shapes=("smollm2-135m",), single_tokens=32, batch_steps=16, prefill_reps=2,
             hf_single_tokens=16, hf_batch_steps=8, busy_steps=8, correctness_prompts=4,
             correctness_tokens=16, host=HostPlan(steps=50, warmup=5, rounds=1))


@dataclass
class ShapeResult:
    """Every cell of one shape: a measurement, a Failure, or None (not run)."""

    name: str
    cells: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (CUDA when visible), cpu, cuda or cuda:N")
    p.add_argument("--only", nargs="+", choices=SECTIONS, help="run these sections only")
    p.add_argument("--host-only", action="store_true", help="the host section alone (same as --only host)")
    p.add_argument("--quick", action="store_true", help="a smoke run: SmolLM2 shape, few steps")
    p.add_argument("--shapes", nargs="+", choices=list(model_shapes.SHAPES), help="shapes to run")
    p.add_argument("--baseline-rev", default=BASELINE_REV,
                   help=f"the host section's baseline revision (default {BASELINE_REV})")
    p.add_argument("--baseline-archive", type=Path, default=None,
                   help="host section: the baseline as a git archive (.tar.gz), where no git repository is")
    p.add_argument("--no-baseline", action="store_true", help="host section: the working tree only")
    p.add_argument("--host-devices", nargs="+", default=None,
                   help="host section devices (default: cpu, and the GPU when the run has one)")
    p.add_argument("--host-steps", type=int, default=None, help="timed steps per batch and round")
    p.add_argument("--rounds", type=int, default=None, help="host section: rounds over the trees")
    p.add_argument("--kv-cache-memory", default="8GiB", help="KV cache of each benchmark engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--markdown", type=Path, default=None, help="also write the printed tables here")
    args = p.parse_args(argv)
    if args.host_only and args.only:
        p.error("--host-only and --only exclude each other: --host-only is --only host")
    if args.host_steps is not None and args.host_steps < 1:
        p.error(f"--host-steps must be >= 1, got {args.host_steps}")
    if args.rounds is not None and args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    try:
        args.device = resolve_device(args.device)
    except ValueError as e:
        p.error(str(e))
    wanted = ["host"] if args.host_only else list(args.only or SECTIONS)
    gpu_wanted = [s for s in wanted if s in GPU_SECTIONS]
    if args.device == "cpu" and gpu_wanted and args.only:
        p.error(f"sections {', '.join(gpu_wanted)} need a CUDA device; this run's device is cpu "
                "(torch sees no GPU or --device cpu): use --host-only")
    args.sections = [s for s in wanted if args.device != "cpu" or s not in GPU_SECTIONS]
    if args.host_devices is None:
        args.host_devices = ["cpu"] + ([args.device] if args.device != "cpu" and not args.host_only else [])
    return args


def resolve_device(device: str) -> str:
    """auto -> cuda when torch sees a GPU, else cpu; cuda/cuda:N must exist."""
    import torch

    name = device.strip().lower()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "auto":
        return "cuda" if count else "cpu"
    if name == "cpu":
        return name
    if not (name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit())):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if not count:
        raise ValueError(f"--device {device} asks for a GPU, but torch {torch.__version__} sees none "
                         f"(CUDA build: {torch.version.cuda or 'no'}); use --host-only on this machine")
    if name.startswith("cuda:") and int(name[5:]) >= count:
        raise ValueError(f"--device {device}: this machine has {count} GPU(s)")
    return name


def plan_of(args: argparse.Namespace) -> Plan:
    plan = QUICK if args.quick else Plan()
    changes: dict[str, Any] = {}
    if args.shapes:
        changes["shapes"] = tuple(args.shapes)
    host = plan.host
    if args.host_steps is not None:
        host = replace(host, steps=args.host_steps)
    if args.rounds is not None:
        host = replace(host, rounds=args.rounds)
    return replace(plan, host=host, **changes)


# ----------------------------------------------------------------------------- GPU sections
def run_shape(name: str, args: argparse.Namespace, plan: Plan, throughput: Section | None,
              busy: Section | None) -> ShapeResult:
    """kvrelay's measurements of one shape, then transformers' on the same tensors."""
    import torch

    result = ShapeResult(name)
    device, seed, label = args.device, args.seed, model_shapes.DISPLAY_NAMES[name]
    first = throughput or busy
    assert first is not None
    config = model_shapes.shape_config(name)
    weights = first.attempt(f"{label}: random weights",
                           lambda: model_shapes.random_weights(config, seed, getattr(torch, plan.dtype),
                                                               device))
    if isinstance(weights, Failure):
        result.cells = {"weights": weights}
        return result
    llm = first.attempt(f"{label}: kvrelay engine ({plan.dtype})",
                        lambda: measure.kvrelay_llm(model_shapes.loaded_model(config, weights, label), device,
                                                    plan.dtype, args.kv_cache_memory, seed))
    engine = None if isinstance(llm, Failure) else llm.engine
    cells = result.cells

    def kv(section: Section, key: str, what: str, fn: Any) -> None:
        cells[key] = llm if engine is None else section.attempt(f"{label}: {what}", fn)

    if throughput is not None:
        kv(throughput, "kv_single", "kvrelay single-stream decode",
           lambda: measure.kvrelay_decode(engine, device, 1, plan.single_prompt_len, plan.single_tokens,
                                          plan.decode_warmup, seed + 1))
        kv(throughput, "kv_batch", f"kvrelay batch-{plan.batch} decode",
           lambda: measure.kvrelay_decode(engine, device, plan.batch, plan.batch_prompt_len,
                                          plan.batch_steps, plan.decode_warmup, seed + 2))
        kv(throughput, "kv_prefill", f"kvrelay prefill {plan.prefill_tokens}",
           lambda: measure.kvrelay_prefill(engine, device, plan.prefill_tokens, plan.prefill_reps, 1,
                                           seed + 3))
    if busy is not None:
        for batch in plan.busy_batches:
            kv(busy, f"busy_{batch}", f"GPU busy, batch {batch}", lambda batch=batch: measure.kvrelay_busy(
                engine, device, batch, plan.batch_prompt_len, plan.busy_steps, plan.decode_warmup,
                seed + 9 * batch))
    if not isinstance(llm, Failure):
        first.attempt(f"{label}: kvrelay engine shutdown", llm.shutdown)
    free_device_memory()
    if throughput is not None:
        hf_cells(label, config, weights, device, plan, seed, throughput, cells)
    return result  # NOTE: the caller frees the device memory once the weights are out of scope


def hf_cells(label: str, config: dict[str, Any], weights: dict[str, Any], device: str, plan: Plan,
             seed: int, section: Section, cells: dict[str, Any]) -> None:
    hf = section.attempt(f"{label}: transformers model", lambda: model_shapes.hf_model(config, weights))
    if isinstance(hf, Failure):
        cells.update(hf_single=hf, hf_batch=hf, hf_prefill=hf)
        return
    cells["hf_single"] = section.attempt(
        f"{label}: transformers single-stream decode",
        lambda: measure.hf_decode(hf, device, 1, plan.single_prompt_len, plan.hf_single_tokens,
                                  plan.decode_warmup, seed))
    cells["hf_batch"] = section.attempt(
        f"{label}: transformers batch-{plan.batch} decode",
        lambda: measure.hf_decode(hf, device, plan.batch, plan.batch_prompt_len, plan.hf_batch_steps,
                                  plan.decode_warmup, seed))
    cells["hf_prefill"] = section.attempt(
        f"{label}: transformers prefill {plan.prefill_tokens}",
        lambda: measure.hf_prefill(hf, device, plan.prefill_tokens, plan.prefill_reps, 1, seed))


def rate_text(cell: Any) -> str:
    """A Rate as tok/s; a Failure's text; "not run" for None."""
    if cell is None:
        return "not run"
    if isinstance(cell, Failure):
        return str(cell)
    return f"{cell.tokens_per_s:,.0f} tok/s"


def ratio_text(a: Any, b: Any) -> str:
    if isinstance(a, measure.Rate) and isinstance(b, measure.Rate):
        return f"{a.tokens_per_s / b.tokens_per_s:.2f}x"
    return "-"


def met(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "NO")


def throughput_table(results: list[ShapeResult], plan: Plan) -> Table:
    table = Table("Throughput, bf16, random weights of real shapes (higher is better)",
                  ["shape", "measurement", "kvrelay", "transformers", "kvrelay / transformers",
                   "target", "met"])
    for res in results:
        label, target, c = model_shapes.DISPLAY_NAMES[res.name], TARGETS[res.name], res.cells
        rows = [("single-stream decode", "kv_single", "hf_single", target.single_tok_s),
                (f"batch-{plan.batch} decode", "kv_batch", "hf_batch", target.batch_tok_s)]
        for what, kv_key, hf_key, floor in rows:
            kv, hf = c.get(kv_key, c.get("weights")), c.get(hf_key, c.get("weights"))
            ok = kv.tokens_per_s >= floor if isinstance(kv, measure.Rate) else None
            table.rows.append([label, what, rate_text(kv), rate_text(hf), ratio_text(kv, hf),
                               f">= {floor:,.0f} tok/s", met(ok)])
        kv, hf = c.get("kv_prefill", c.get("weights")), c.get("hf_prefill", c.get("weights"))
        ok = None
        if target.prefill_ratio is not None and isinstance(kv, measure.Rate) and isinstance(hf, measure.Rate):
            ok = kv.tokens_per_s / hf.tokens_per_s >= target.prefill_ratio
        goal = f">= {target.prefill_ratio:.1f}x transformers" if target.prefill_ratio else "-"
        table.rows.append([label, f"prefill {plan.prefill_tokens} tokens", rate_text(kv), rate_text(hf),
                           ratio_text(kv, hf), goal, met(ok)])
        steps = [f"{k} {v.step_ms:.2f} ms" for k, v in c.items() if isinstance(v, measure.Rate)]
        if steps:
            table.notes.append(f"{label}, median ms per step (decode) or per prefill: " + ", ".join(steps))
        prefill = c.get("kv_prefill")
        if isinstance(prefill, measure.Rate) and prefill.steps_per_prefill > 1:
            table.notes.append(f"{label}: kvrelay's prefill took {prefill.steps_per_prefill} engine steps")
    table.notes.append(
        f"kvrelay: CUDA graphs on, {plan.single_tokens} timed tokens single-stream after a "
        f"{plan.single_prompt_len}-token prompt, {plan.batch_steps} pure decode steps of {plan.batch} "
        f"requests ({plan.batch_prompt_len}-token prompts), {plan.prefill_reps} fresh prompts for prefill "
        f"(median). transformers: greedy loop over its forward with the default dynamic cache, sdpa, "
        f"eager; {plan.hf_single_tokens} / {plan.hf_batch_steps} timed steps; prefill = one forward.")
    return table


def busy_table(results: list[ShapeResult], plan: Plan) -> Table:
    table = Table("GPU busy share of kvrelay's decode wall time (torch.profiler, CUDA activity)",
                  ["shape", "batch", "GPU busy", "target", "met", "wall ms/step", "GPU ms/step",
                   "kernels/step"])
    for res in results:
        label = model_shapes.DISPLAY_NAMES[res.name]
        for batch in plan.busy_batches:
            cell = res.cells.get(f"busy_{batch}", res.cells.get("weights"))
            if isinstance(cell, measure.Busy):
                table.rows.append([label, str(batch), f"{100 * cell.share:.1f}%",
                                   f">= {100 * BUSY_TARGET:.0f}%", met(cell.share >= BUSY_TARGET),
                                   f"{cell.wall_ms_per_step:.3f}", f"{cell.gpu_ms_per_step:.3f}",
                                   f"{cell.kernels_per_step:.0f}"])
            else:
                text = "not run" if cell is None else str(cell)
                goal = f">= {100 * BUSY_TARGET:.0f}%"
                table.rows.append([label, str(batch), text, goal, "-", "-", "-", "-"])
    table.notes.append(f"{plan.busy_steps} decode steps after {plan.decode_warmup} warm-up steps; "
                       "busy = union of kernel/copy/memset intervals / host wall time of the steps.")
    return table


# ----------------------------------------------------------------------------- summary and main
def summary_table(results: list[ShapeResult], sections: dict[str, Section], plan: Plan) -> Table:
    """Issue 32's GPU targets, each with what this run measured."""
    table = Table("Summary: issue 32's GPU targets", ["target", "measured", "met"])
    for res in results:
        label, target, c = model_shapes.DISPLAY_NAMES[res.name], TARGETS[res.name], res.cells
        for what, key, floor in (("single-stream decode", "kv_single", target.single_tok_s),
                                 (f"batch-{plan.batch} decode", "kv_batch", target.batch_tok_s)):
            if "throughput" in sections:
                cell = c.get(key, c.get("weights"))
                ok = cell.tokens_per_s >= floor if isinstance(cell, measure.Rate) else None
                table.rows.append([f"{label} {what} >= {floor:,.0f} tok/s", rate_text(cell), met(ok)])
        if "throughput" in sections and target.prefill_ratio is not None:
            kv, hf = c.get("kv_prefill", c.get("weights")), c.get("hf_prefill", c.get("weights"))
            ok = None
            if isinstance(kv, measure.Rate) and isinstance(hf, measure.Rate):
                ok = kv.tokens_per_s / hf.tokens_per_s >= target.prefill_ratio
            table.rows.append([f"{label} prefill {plan.prefill_tokens} >= {target.prefill_ratio:.1f}x "
                               "transformers", ratio_text(kv, hf), met(ok)])
        if "busy" in sections:
            for batch in plan.busy_batches:
                cell = c.get(f"busy_{batch}", c.get("weights"))
                text = f"{100 * cell.share:.1f}%" if isinstance(cell, measure.Busy) else rate_text(cell)
                ok = cell.share >= BUSY_TARGET if isinstance(cell, measure.Busy) else None
                table.rows.append([f"{label} GPU busy at batch {batch} >= {100 * BUSY_TARGET:.0f}%",
                                   text, met(ok)])
    agreements = sections["correctness"].results.get("correctness") if "correctness" in sections else None
    if agreements:
        for what, key in (("fp32 greedy tokens = transformers' on every prompt", "triton"),
                          ("CUDA-graph tokens identical to eager", "graphs")):
            found = agreements[key]
            measured = "FAILED" if found.failed else f"{found.equal}/{len(found.cells)}"
            table.rows.append([what, measured, met(found.met())])
    return table


def run_sections(args: argparse.Namespace, plan: Plan, sections: dict[str, Section],
                 results: list[ShapeResult]) -> None:
    """Fill `sections` and `results` as the run goes, so that an interrupted run still has what
    it measured (main prints it)."""
    if "host" in sections:
        host = sections["host"]
        baseline = None if args.no_baseline else args.baseline_archive or args.baseline_rev
        timed(host, lambda: host_section(baseline, args.host_devices, plan.host, host))
    throughput, busy = sections.get("throughput"), sections.get("busy")
    first = throughput or busy
    if first is not None:
        start = time.monotonic()
        for name in plan.shapes:
            result = first.attempt(name, functools.partial(run_shape, name, args, plan, throughput, busy))
            results.append(ShapeResult(name, {"weights": result}) if isinstance(result, Failure) else result)
            free_device_memory()
            for section in (throughput, busy):
                if section is not None:
                    section.seconds = time.monotonic() - start  # the two share each shape's engine
    if "correctness" in sections:
        correctness = sections["correctness"]
        timed(correctness, lambda: correctness_section(args.device, args.seed, plan.correctness_prompts,
                                                       plan.correctness_tokens, correctness))


def shape_tables(sections: dict[str, Section], results: list[ShapeResult], plan: Plan) -> None:
    """The throughput and busy tables, from the shapes measured so far."""
    for name, build in (("throughput", throughput_table), ("busy", busy_table)):
        if name in sections and results:
            add_table(sections[name], lambda build=build: build(results, plan))


def add_table(section: Section, build: Any) -> None:
    """The table `build()` makes, or its failure printed: a broken table never stops the run."""
    table = section.attempt("table", build)
    if isinstance(table, Table):
        section.tables.append(table)


def timed(section: Section, fn: Any) -> None:
    start = time.monotonic()
    try:
        section.attempt("section", fn)
    finally:
        section.seconds = time.monotonic() - start


def header_lines(args: argparse.Namespace, argv: list[str]) -> list[str]:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    cpu_detail = "host" in args.sections and "cpu" in args.host_devices  # the CPU's ISA matters there
    command = f"command: python benchmarks/bench_gpu.py {shlex.join(argv)}".rstrip()
    return [f"## bench_gpu, {now}", "", command, *machine_lines(args.device, cpu_detail)]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    plan = plan_of(args)
    if args.device == "cpu" and not args.only and not args.host_only:
        print("no CUDA device: only the host section runs (the others need a GPU)", flush=True)
    start = time.monotonic()
    sections = {name: Section(name) for name in args.sections}
    results: list[ShapeResult] = []
    signal.signal(signal.SIGTERM, stop_on_sigterm)  # `timeout` stops a run: print what it has
    interrupted = False
    try:
        run_sections(args, plan, sections, results)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: the tables below hold what was measured before", flush=True)
    shape_tables(sections, results, plan)
    lines = header_lines(args, argv)
    lines.append(f"sections: {', '.join(f'{n} {s.seconds:.0f} s' for n, s in sections.items())}; "
                 f"total {time.monotonic() - start:.0f} s")
    tables = [t for s in sections.values() for t in s.tables]
    summary = Section("summary")
    if any(s in sections for s in GPU_SECTIONS):
        add_table(summary, lambda: summary_table(results, sections, plan))
    failures = [f"{s.name}: {f['what']}: {f['error']}" for s in (*sections.values(), summary)
                for f in s.failures]
    text = "\n".join(lines) + "\n\n" + "\n\n".join(t.render() for t in (*tables, *summary.tables))
    if interrupted:
        failures.append("the run was interrupted before it finished")
    if failures:
        text += "\n\nFailures (tracebacks above):\n" + "\n".join(f"- {f}" for f in failures)
    text += "\n\n" + verdict_line(summary.tables, failures)
    print("\n" + text, flush=True)
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text + "\n")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"header": lines, "plan": plan.__dict__, "failures": failures,
                                         "sections": {n: s.as_dict() for n, s in sections.items()},
                                         "summary": [t.as_dict() for t in summary.tables]},
                                        indent=1, default=str))
    return 1 if failures else 0


def stop_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def verdict_line(summary_tables: list[Table], failures: list[str]) -> str:
    """One line for scripts/gpu_check.sh: failures, and how many targets were met."""
    rows = [row for t in summary_tables for row in t.rows]
    missed = [row[0] for row in rows if row[-1] == "NO"]
    measured = sum(row[-1] in ("yes", "NO") for row in rows)
    line = f"bench_gpu: {len(failures)} failure(s)"
    if rows:
        line += f"; targets met {measured - len(missed)} of {measured} measured ({len(rows)} in all)"
    if missed:
        line += "; missed: " + "; ".join(missed)
    return line


if __name__ == "__main__":
    sys.exit(main())

"""bench_gpu.py's correctness section: greedy tokens of kvrelay against transformers in float32,
and CUDA-graph against eager tokens in bf16, on a 4-layer model of the SmolLM2 shape.

The model is small so that float32 runs quickly, and its weights are wider than the throughput
runs' (std 0.05): with std 0.02 a random model's greedy text is one token repeated, which would
make the comparison toothless. Each prompt's cell says "equal", or where the first difference is
with transformers' top-2 logit gap there (a gap near 1e-5 is a near tie, not necessarily a bug).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import gpu_measure as measure
import model_shapes
from gpu_report import Failure, Section, Table, free_device_memory

# A 4-layer model of the SmolLM2 shape: real head counts and vocabulary, quick in float32.
CONFIG = model_shapes.shape_config("smollm2-135m", num_hidden_layers=4)
LABEL = "SmolLM2-135M shape, 4 layers"
STD = 0.05  # std 0.02 makes a random model repeat one token; 0.05 gives varied text
PROMPT_LENS = (3, 9, 17, 33, 64, 100, 160, 250)
# Column key -> (engine dtype, what, extra LLM arguments). "graphs" and "eager" compare to each
# other; the float32 ones to transformers.
RUNS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "triton": ("float32", "fp32, default route (triton)", {}),
    "torch": ("float32", "fp32, torch route", {"attention_backend": "torch"}),
    "graphs": ("bfloat16", "bf16, CUDA graphs", {}),
    "eager": ("bfloat16", "bf16, eager", {"enforce_eager": True}),
}


@dataclass
class Agreement:
    """Per prompt, for one comparison: the cell texts, how many agreed, whether any failed."""

    cells: list[str] = field(default_factory=list)
    equal: int = 0
    failed: bool = False

    def met(self) -> bool | None:
        return None if self.failed else self.equal == len(self.cells)


def correctness_section(device: str, seed: int, num_prompts: int, n: int, section: Section) -> None:
    """fp32 greedy tokens (`n` per prompt): kvrelay's triton and torch routes against
    transformers; bf16 greedy tokens: CUDA graphs against eager. One engine at a time, all
    prompts in one batch."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 on both sides
    torch.backends.cudnn.allow_tf32 = False
    config = CONFIG
    prompts = [measure.random_prompts(1, length, config["vocab_size"], seed + i)[0]
               for i, length in enumerate(PROMPT_LENS[:num_prompts])]
    weights = section.attempt(f"{LABEL}: random fp32 weights", lambda: (
        model_shapes.random_weights(config, seed + 1, torch.float32, device, std=STD)))
    if isinstance(weights, Failure):
        runs: dict[str, Any] = dict.fromkeys(RUNS, weights)
        reference: Any = weights
    else:
        reference = section.attempt(f"{LABEL}: transformers fp32 greedy", lambda: [
            measure.hf_greedy_tokens(model_shapes.hf_model(config, weights), device, p, n) for p in prompts])
        free_device_memory()
        runs = {key: section.attempt(f"{LABEL}: kvrelay {what}", functools.partial(
                    kvrelay_tokens, config, weights, dtype, prompts, n, device, seed, **extra))
                for key, (dtype, what, extra) in RUNS.items()}
    agreements = {key: compare(runs[key], reference, len(prompts)) for key in ("triton", "torch")}
    agreements["graphs"] = compare(runs["graphs"], runs["eager"], len(prompts), with_gaps=False)
    section.results["correctness"] = agreements
    section.tables.append(correctness_table(prompts, agreements, n))


def kvrelay_tokens(config: dict[str, Any], weights: dict[str, Any], dtype: str, prompts: list[list[int]],
                   max_tokens: int, device: str, seed: int, **extra: Any) -> list[list[int]]:
    import torch

    tensors = weights if dtype == "float32" else {k: v.to(getattr(torch, dtype)) for k, v in weights.items()}
    llm = measure.kvrelay_llm(model_shapes.loaded_model(config, tensors, "correctness"), device, dtype,
                              "256MiB", seed, max_model_len=1024, max_num_seqs=16, **extra)
    try:
        return measure.kvrelay_greedy_tokens(llm.engine, prompts, max_tokens)
    finally:
        llm.shutdown()
        free_device_memory()


def compare(got: Any, want: Any, count: int, with_gaps: bool = True) -> Agreement:
    """Prompt by prompt: "equal", where the first difference is (with transformers' top-2 logit
    gap there), or the failure that left nothing to compare."""
    failure = got if isinstance(got, Failure) else want if isinstance(want, Failure) else None
    if failure is not None:
        return Agreement(cells=[str(failure)] * count, failed=True)
    result = Agreement()
    for i in range(count):
        tokens, gaps = want[i] if with_gaps else (want[i], None)
        index = measure.first_difference(got[i], tokens)
        if index is None:
            result.cells.append("equal")
            result.equal += 1
        else:
            gap = f", top-2 gap {gaps[index]:.2g}" if gaps is not None and index < len(gaps) else ""
            result.cells.append(f"differs at token {index}{gap}")
    return result


def correctness_table(prompts: list[list[int]], agreements: dict[str, Agreement], n: int) -> Table:
    table = Table(f"Greedy tokens, {LABEL}, {n} new tokens per prompt",
                  ["prompt", "tokens", "fp32 kvrelay (triton) = transformers",
                   "fp32 kvrelay (torch route) = transformers", "bf16 CUDA graphs = eager"])
    keys = ("triton", "torch", "graphs")
    for i, prompt in enumerate(prompts):
        table.rows.append([str(i + 1), str(len(prompt)), *(agreements[k].cells[i] for k in keys)])
    table.rows.append(["all", "-", *(f"{agreements[k].equal}/{len(prompts)}" for k in keys)])
    table.notes.append("targets: fp32 tokens equal transformers' on every prompt; graph tokens identical "
                       "to eager. Weights std 0.05, norm weights 1 + N(0, 0.1); TF32 off. A difference "
                       "where transformers' top-2 logit gap is ~1e-5 is a near tie, not necessarily a bug.")
    return table



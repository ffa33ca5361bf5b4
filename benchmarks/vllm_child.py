"""The vLLM side of bench_offline, run by vllm_runner.py with a vLLM environment's interpreter.

Reads the workload (JSON) from stdin, prints one JSON line of timings on stdout. It imports only
the standard library and vLLM, never kvrelay. The timed parts mirror bench_offline's kvrelay rows:

1. single stream: one greedy request (ignore_eos) as a warm-up, then the same request timed;
2. mixed workload: every request submitted at once to one `generate` call, timed.

The engine's construction (weights, its own profiling and compilation) is not timed, as kvrelay's
is not.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    work = json.loads(sys.stdin.read())
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=work["model"], served_model_name=work["served_name"], dtype=work["dtype"],
              max_num_seqs=work["max_num_seqs"], max_num_batched_tokens=work["max_num_batched_tokens"],
              seed=0)

    single_s, single_ids = 0.0, []
    if work["single_tokens"] > 0:
        single = [{"prompt_token_ids": work["single_prompt"]}]
        params = SamplingParams(temperature=0.0, max_tokens=work["single_tokens"], ignore_eos=True)
        llm.generate(single, params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        single_out = llm.generate(single, params, use_tqdm=False)
        single_s = time.perf_counter() - start
        single_ids = list(single_out[0].outputs[0].token_ids)

    mixed_s, mixed_lengths = 0.0, []
    if work["mixed"]:
        mixed = [{"prompt_token_ids": r["prompt"]} for r in work["mixed"]]
        mixed_params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
                        for r in work["mixed"]]
        start = time.perf_counter()
        mixed_out = llm.generate(mixed, mixed_params, use_tqdm=False)
        mixed_s = time.perf_counter() - start
        mixed_lengths = [len(o.outputs[0].token_ids) for o in mixed_out]

    print(json.dumps({
        "version": vllm.__version__, "single_s": single_s, "single_token_ids": single_ids,
        "mixed_s": mixed_s, "mixed_output_tokens": mixed_lengths,
    }), flush=True)


if __name__ == "__main__":
    main()

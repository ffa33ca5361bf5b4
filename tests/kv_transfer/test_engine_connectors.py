"""Connectors end to end in the engine, on a tiny random llama: KV saved by one engine is
loaded by a fresh one (also in another process) with identical greedy tokens, through
ExampleConnector and MultiConnector; a corrupt entry is recomputed; and the worker-side hooks
run in their order on every step, with or without tokens. Every test ends with no block in use
and no pending work."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvrelay import LLM, SamplingParams
from tests.kv_transfer.fake_connector import capture_fake_connectors, fake_transfer_config
from tests.tiny import hf_greedy, hf_model, tiny_loaded_model

BLOCK_SIZE = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
REPO_ROOT = Path(__file__).resolve().parents[2]


def example_config(path: Path) -> dict[str, Any]:
    return {"kv_connector": "ExampleConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


def multi_config(*paths: Path) -> dict[str, Any]:
    return {"kv_connector": "MultiConnector",
            "kv_connector_extra_config": {"connectors": [example_config(p) for p in paths]}}


def make_llm(kv_transfer_config: dict[str, Any]) -> LLM:
    return LLM(loaded_model=tiny_loaded_model("llama"), num_blocks=64, block_size=BLOCK_SIZE,
               kv_transfer_config=kv_transfer_config)


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(n)] for n in lengths]


PROMPTS = prompts_of([9, 14, 21])
# What ExampleConnector stores: the block-aligned prefix that leaves at least one token.
STORED = [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in PROMPTS]


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outs]


def hf_tokens(prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(hf_model("llama"), p, GREEDY.max_tokens or 0)[0] for p in prompts]


def assert_no_leak(llm: LLM) -> None:
    assert llm.engine.blocks_in_use == 0
    assert not llm.engine.has_pending_work()


def stored_entries(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


def save_with_engine(kv_transfer_config: dict[str, Any]) -> list[list[int]]:
    """Engine A: computes every prompt and saves its prefix."""
    llm = make_llm(kv_transfer_config)
    tokens = generate(llm, PROMPTS)
    stats = llm.engine.get_stats()
    assert stats["prompt_tokens_computed"] == sum(map(len, PROMPTS)) and stats["prompt_tokens_external"] == 0
    assert_no_leak(llm)
    return tokens


def assert_loaded_everything_stored(stats: dict[str, Any], connector_name: str) -> None:
    assert stats["prompt_tokens_external"] == sum(STORED)
    assert stats["prompt_tokens_external_by_connector"] == {connector_name: sum(STORED)}
    assert stats["prompt_tokens_computed"] == sum(len(p) - n for p, n in zip(PROMPTS, STORED, strict=True))
    assert stats["prompt_tokens_cached"] == 0 and stats["kv_load_failures"] == 0


def test_fresh_engine_loads_saved_kv_and_computes_only_the_rest(tmp_path):
    saved_tokens = save_with_engine(example_config(tmp_path))
    assert len(stored_entries(tmp_path)) == len(PROMPTS)
    llm = make_llm(example_config(tmp_path))
    assert generate(llm, PROMPTS) == saved_tokens == hf_tokens(PROMPTS)
    assert_loaded_everything_stored(llm.engine.get_stats(), "ExampleConnector")
    assert_no_leak(llm)


_OTHER_PROCESS = """
import json, sys
from kvrelay import LLM, SamplingParams
from tests.tiny import tiny_loaded_model
prompts, path = json.loads(sys.argv[1]), sys.argv[2]
llm = LLM(loaded_model=tiny_loaded_model("llama"), num_blocks=64, block_size=4,
          kv_transfer_config={"kv_connector": "ExampleConnector",
                              "kv_connector_extra_config": {"shared_storage_path": path}})
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
stats = llm.engine.get_stats()
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "stats": stats,
                  "blocks_in_use": llm.engine.blocks_in_use,
                  "pending": llm.engine.has_pending_work()}))
"""


def test_engine_in_another_process_loads_the_saved_kv(tmp_path):
    saved_tokens = save_with_engine(example_config(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-c", _OTHER_PROCESS, json.dumps(PROMPTS), str(tmp_path)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"] == saved_tokens
    assert_loaded_everything_stored(result["stats"], "ExampleConnector")
    assert result["blocks_in_use"] == 0 and not result["pending"]


def test_multi_connector_saves_to_every_child_and_loads_from_the_one_that_has_it(tmp_path):
    first, second, empty = tmp_path / "first", tmp_path / "second", tmp_path / "empty"
    saved_tokens = save_with_engine(multi_config(first, second))
    assert [p.name for p in stored_entries(first)] == [p.name for p in stored_entries(second)]
    assert len(stored_entries(second)) == len(PROMPTS)
    llm = make_llm(multi_config(empty, second))
    assert generate(llm, PROMPTS) == saved_tokens == hf_tokens(PROMPTS)
    assert_loaded_everything_stored(llm.engine.get_stats(), "MultiConnector")
    assert_no_leak(llm)


def test_corrupt_stored_entry_is_recomputed_with_the_right_tokens(tmp_path):
    saved_tokens = save_with_engine(example_config(tmp_path))
    entries = stored_entries(tmp_path)
    corrupt = entries[0]
    layer_file = sorted(corrupt.iterdir())[-1]
    layer_file.write_bytes(b"not a safetensors file" + layer_file.read_bytes()[:100])
    llm = make_llm(example_config(tmp_path))
    assert generate(llm, PROMPTS) == saved_tokens == hf_tokens(PROMPTS)
    stats = llm.engine.get_stats()
    assert stats["kv_load_failures"] >= 1
    # The corrupt entry's prefix was computed after all; the other two were loaded.
    assert stats["prompt_tokens_computed"] + stats["prompt_tokens_external"] == sum(map(len, PROMPTS))
    assert 0 < stats["prompt_tokens_external"] < sum(STORED)
    assert_no_leak(llm)
    # The recompute saved it again, intact: a third engine loads everything.
    third = make_llm(example_config(tmp_path))
    assert generate(third, PROMPTS) == saved_tokens
    assert_loaded_everything_stored(third.engine.get_stats(), "ExampleConnector")
    assert_no_leak(third)


def split_steps(calls: list[tuple[Any, ...]]) -> list[list[str]]:
    """The worker connector's calls (names, with the layer for per-layer hooks), one list per step."""
    steps: list[list[str]] = []
    for call in calls:
        if call[0] == "register_kv_caches":
            continue
        if call[0] == "bind_connector_metadata":
            steps.append([])
        name = f"{call[0]}:{call[1]}" if call[0] in ("wait_for_layer_load", "save_kv_layer") else call[0]
        steps[-1].append(name)
    return steps


def test_worker_hooks_run_in_order_on_every_step_with_or_without_tokens():
    prompt = prompts_of([10], seed=7)[0]
    config = fake_transfer_config(
        external_tokens=[{"prompt_token_ids": prompt, "available_tokens": len(prompt), "load_async": True}],
        auto_finish_recving_after=3)
    with capture_fake_connectors() as created:
        llm = LLM(loaded_model=tiny_loaded_model("llama"), num_blocks=64, block_size=BLOCK_SIZE,
                  kv_transfer_config=config)
    scheduler_side, worker = created
    assert worker.calls[0] == ("register_kv_caches", ["model.layers.0.self_attn.attn",
                                                      "model.layers.1.self_attn.attn"])
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2
    empty = ["bind_connector_metadata", "start_load_kv", "wait_for_save", "get_finished",
             "clear_connector_metadata"]
    layers = [f"{hook}:model.layers.{i}.self_attn.attn"
              for i in range(2) for hook in ("wait_for_layer_load", "save_kv_layer")]
    with_tokens = empty[:2] + layers + empty[2:]
    # Steps 1-4: the load runs (it settles at the end of step 4) and no token is computed;
    # step 5 computes the last prompt token, step 6 the second output token.
    assert split_steps(worker.calls) == [empty] * 4 + [with_tokens] * 2
    assert [len(meta.loads) for meta in worker.bound] == [1, 0, 0, 0, 0, 0]
    stats = llm.engine.get_stats()
    assert stats["prompt_tokens_external_by_connector"] == {"FakeConnector": len(prompt) - 1}
    assert stats["prompt_tokens_computed"] == 1
    assert not scheduler_side.loading
    assert_no_leak(llm)

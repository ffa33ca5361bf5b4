"""Builders for the engine-level offload tests: a tiny llama, prompts, configs, and a fresh
engine in another process."""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvrelay import LLM, SamplingParams
from tests.tiny import tiny_loaded_model

BLOCK_SIZE = 4
CHUNK_TOKENS = 16  # 4 blocks
NUM_BLOCKS = 128
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
REPO_ROOT = Path(__file__).resolve().parents[3]


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(n)] for n in lengths]


def stored_prefix(prompt: list[int]) -> int:
    """Tokens of `prompt` a store serves after computing it: its full chunks and its tail, less
    the last token (always computed: its logits give the first output token)."""
    return len(prompt) - 1


def stored_entries(prompt: list[int]) -> int:
    """Entries a store holds after computing `prompt`: its full chunks, and its tail (the tokens
    past the last full chunk) unless that is a single token, which would never be loaded."""
    return len(prompt) // CHUNK_TOKENS + int(len(prompt) % CHUNK_TOKENS >= 2)


def offload_config(**extra: Any) -> dict[str, Any]:
    return {"kv_connector": "OffloadConnector",
            "kv_connector_extra_config": {"chunk_tokens": CHUNK_TOKENS, "max_pending_stores": 64, **extra}}


# Every LLM a test builds, shut down after the test (conftest.py): its store threads end with it.
LIVE_LLMS: list[LLM] = []


def make_llm(kv_transfer_config: dict[str, Any] | None, num_blocks: int = NUM_BLOCKS) -> LLM:
    llm = LLM(loaded_model=tiny_loaded_model("llama"), num_blocks=num_blocks, block_size=BLOCK_SIZE,
              kv_transfer_config=kv_transfer_config)
    LIVE_LLMS.append(llm)
    return llm


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    llm.engine.run_until_idle()  # let the background stores land (and report their stats)
    return [out.outputs[0].token_ids for out in outs]


@functools.lru_cache(maxsize=32)
def _reference(prompt: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(generate(make_llm(None), [list(prompt)])[0])


def reference_tokens(prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of an engine without any connector."""
    return [list(_reference(tuple(p))) for p in prompts]


def connector_stats(llm: LLM) -> dict[str, float]:
    return llm.engine.scheduler.connector.take_stats()


def fresh_prefix_cache(llm: LLM) -> None:
    """Forget the local prefix cache, so only the offload store can serve a repeated prompt."""
    assert llm.engine.scheduler.reset_prefix_cache()


def assert_no_leak(llm: LLM) -> None:
    assert llm.engine.blocks_in_use == 0
    assert not llm.engine.has_pending_work()


def assert_loaded_stored_prefixes(stats: dict[str, Any], prompts: list[list[int]]) -> None:
    """Every stored prefix came from the offload store; only the tokens after it were computed."""
    stored = sum(stored_prefix(p) for p in prompts)
    assert stats["prompt_tokens_external"] == stored
    assert stats["prompt_tokens_computed"] == sum(len(p) for p in prompts) - stored
    assert stats["kv_load_failures"] == 0


_FRESH_ENGINE = """
import json, sys
from tests.kv_transfer.offload.helpers import connector_stats, generate, make_llm
prompts, config = json.loads(sys.argv[1]), json.loads(sys.argv[2])
llm = make_llm(config)
tokens = generate(llm, prompts)
print(json.dumps({"tokens": tokens, "stats": llm.engine.get_stats(), "connector": connector_stats(llm),
                  "blocks_in_use": llm.engine.blocks_in_use, "pending": llm.engine.has_pending_work()}))
"""


def run_in_fresh_process(prompts: list[list[int]], config: dict[str, Any]) -> dict[str, Any]:
    """A new process builds an engine with `config` and generates `prompts`."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-c", _FRESH_ENGINE, json.dumps(prompts), json.dumps(config)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["blocks_in_use"] == 0 and not result["pending"]
    return result

"""Builders for the tests of kvrelay's vLLM connectors: configs, prompts, requests, metrics.

Every server runs the default model (SmolLM2-135M-Instruct) in float32 with greedy decoding, so
answers compare token for token; vLLM's block size is its CPU default (128) and a kvrelay
instance that pairs with it runs the same.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from tests.entrypoints.serve_process import ServeProcess, free_port
from tests.vllm_serve import SERVED_NAME, hf_model_dir

MAX_TOKENS = 12
BLOCK_SIZE = 128  # vLLM CPU's default block size; a kvrelay instance in the fleet uses it too
PROMPT_LENGTHS = (300, 470, 640, 810, 980, 1150, 1320, 1500)
MODULE_PATH = "kvrelay.integrations.vllm"


def connector_config(name: str, role: str, *, policy: str = "recompute", port: int | None = None,
                     extra: dict[str, Any] | None = None, module_path: bool = True) -> dict[str, Any]:
    """A vLLM kv_transfer_config for one of kvrelay's connectors (through its module path, or
    only its registered name)."""
    config: dict[str, Any] = {"kv_connector": name, "kv_role": role, "kv_load_failure_policy": policy,
                              "kv_port": port or free_port(), "kv_connector_extra_config": dict(extra or {})}
    if module_path:
        config["kv_connector_module_path"] = MODULE_PATH
    return config


def multi_config(children: Sequence[dict[str, Any]], role: str, policy: str = "recompute") -> dict[str, Any]:
    """vLLM's MultiConnector over `children` (kvrelay's connectors by registered name)."""
    return {"kv_connector": "MultiConnector", "kv_role": role, "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"connectors": list(children)}}


def vllm_args(kv_transfer_config: dict[str, Any], *more: str) -> tuple[str, ...]:
    return ("--kv-transfer-config", json.dumps(kv_transfer_config), *more)


def kvrelay_serve(log_path: Path, kv_transfer_config: dict[str, Any], *more: str) -> ServeProcess:
    """`kvrelay serve` of the same weights and block size as the vLLM servers."""
    return ServeProcess(hf_model_dir(), log_path, "--block-size", str(BLOCK_SIZE), "--dtype", "float32",
                        "--served-model-name", SERVED_NAME,
                        "--kv-transfer-config", json.dumps(kv_transfer_config), *more)


# ---------------------------------------------------------------- prompts

_SUBJECTS = ("the river", "a merchant", "the old library", "our committee", "the northern railway",
             "a young engineer", "the harbor town", "the council", "a travelling musician", "the observatory",
             "my grandmother", "the football club")
_VERBS = ("described", "rebuilt", "measured", "questioned", "celebrated", "recorded", "protected", "studied",
          "ignored", "financed", "painted", "moved")
_OBJECTS = ("the bridge over the canal", "a collection of maps", "the price of grain", "the winter festival",
            "a broken clock tower", "the results of the census", "the new school", "an unusual storm",
            "the trade agreement", "the ancient walls", "a garden of roses", "the night train")
_TAILS = ("in the spring of {year}", "after a long debate", "with great care", "despite the weather",
          "for the first time since {year}", "to everyone's surprise", "while the city slept",
          "before the harvest of {year}")


def prompt_set(seed: int, lengths: Sequence[int] = PROMPT_LENGTHS) -> list[list[int]]:
    """Prompts of exactly `lengths` tokens (token ids), each a run of plain sentences drawn from
    `seed`: distinct sets never share a block, so each test's prompts meet no prefix cache."""
    from kvrelay.model.loader import load_tokenizer

    tokenizer = load_tokenizer(str(hf_model_dir()))
    rng = random.Random(seed)
    prompts = []
    for length in lengths:
        sentences: list[str] = []
        token_ids: list[int] = []
        while len(token_ids) < length:
            tail = rng.choice(_TAILS).format(year=rng.randrange(1700, 2030))
            sentences.append(f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} "
                             f"{rng.choice(_OBJECTS)} {tail}.")
            token_ids = tokenizer.encode(" ".join(sentences))
        prompts.append(token_ids[:length])
    return prompts


# ---------------------------------------------------------------- requests and metrics

def complete(url: str, prompt: Sequence[int] | str, max_tokens: int = MAX_TOKENS, timeout: float = 180,
             **fields: Any) -> httpx.Response:
    body = {"model": SERVED_NAME, "prompt": list(prompt) if not isinstance(prompt, str) else prompt,
            "max_tokens": max_tokens, "temperature": 0.0, **fields}
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


def answer(url: str, prompt: Sequence[int] | str, **fields: Any) -> str:
    """The greedy completion's text (a non-200 answer is an error naming its body)."""
    response = complete(url, prompt, **fields)
    assert response.status_code == 200, f"{url}: {response.status_code} {response.text[:2000]}"
    return str(response.json()["choices"][0]["text"])


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of every sample of `name` on `url`/metrics whose labels include `labels` (0 when
    there is none yet: a counter appears with its first count)."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group(1) != name:
            continue
        found = dict(_LABEL.findall(match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(0.25)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table (the tests print their per-prompt comparisons)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])

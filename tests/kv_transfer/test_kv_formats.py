"""Offload tiers and the Example connector in every KV cache format: an entry written in a format
is loaded back into a cache of that format (same tokens as a single instance of it), and is never
found by a cache of another format (the key is rooted in the compatibility digest)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrelay.engine.llm import LLM
from tests.kv_transfer.offload.helpers import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    assert_loaded_stored_prefixes,
    assert_no_leak,
    generate,
    offload_config,
    prompts_of,
)
from tests.tiny import tiny_loaded_model
from tests.tiny_mla import tiny_mla_model

FORMATS = ["float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"]
PROMPTS = prompts_of([70, 37])


_CREATED: list[LLM] = []


@pytest.fixture(autouse=True)
def _shutdown_engines() -> Iterator[None]:
    """Every engine a test built is shut down after it, so no connector thread outlives it."""
    yield
    while _CREATED:
        _CREATED.pop().shutdown()


def make_llm(kv_cache_dtype: str, kv_transfer_config: dict[str, Any] | None, model: Any = None) -> LLM:
    llm = LLM(loaded_model=model or tiny_loaded_model("llama"), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
              kv_cache_dtype=kv_cache_dtype, kv_transfer_config=kv_transfer_config)
    _CREATED.append(llm)
    return llm


def example_config(path: Path) -> dict[str, Any]:
    return {"kv_connector": "ExampleConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_offload_round_trip_in_each_format(kv_cache_dtype: str, tmp_path: Path) -> None:
    reference = generate(make_llm(kv_cache_dtype, None), PROMPTS)
    writer = make_llm(kv_cache_dtype, offload_config(disk_dir=str(tmp_path)))
    assert generate(writer, PROMPTS) == reference
    assert_no_leak(writer)
    reader = make_llm(kv_cache_dtype, offload_config(disk_dir=str(tmp_path)))  # a fresh instance
    before = reader.engine.get_stats()
    assert generate(reader, PROMPTS) == reference
    after = reader.engine.get_stats()
    keys = ("prompt_tokens_external", "prompt_tokens_computed", "kv_load_failures")
    assert_loaded_stored_prefixes({k: after[k] - before[k] for k in keys}, PROMPTS)
    assert_no_leak(reader)


def test_an_fp32_offload_entry_is_never_loaded_into_an_fp8_cache(tmp_path: Path) -> None:
    writer = make_llm("float32", offload_config(disk_dir=str(tmp_path)))
    generate(writer, PROMPTS)
    assert any(tmp_path.rglob("*")), "the fp32 engine stored nothing"
    reader = make_llm("fp8_e4m3", offload_config(disk_dir=str(tmp_path)))
    assert generate(reader, PROMPTS) == generate(make_llm("fp8_e4m3", None), PROMPTS)
    stats = reader.engine.get_stats()
    assert stats["prompt_tokens_external"] == 0 and stats["kv_load_failures"] == 0
    assert_no_leak(reader)


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_example_connector_round_trip_in_each_format(kv_cache_dtype: str, tmp_path: Path) -> None:
    reference = generate(make_llm(kv_cache_dtype, None), PROMPTS)
    assert generate(make_llm(kv_cache_dtype, example_config(tmp_path)), PROMPTS) == reference
    reader = make_llm(kv_cache_dtype, example_config(tmp_path))
    assert generate(reader, PROMPTS) == reference
    stats = reader.engine.get_stats()
    assert stats["prompt_tokens_external"] > 0 and stats["kv_load_failures"] == 0
    assert_no_leak(reader)


def test_example_entries_of_another_format_are_not_found(tmp_path: Path) -> None:
    generate(make_llm("bfloat16", example_config(tmp_path)), PROMPTS)
    reader = make_llm("float16", example_config(tmp_path))
    generate(reader, PROMPTS)
    assert reader.engine.get_stats()["prompt_tokens_external"] == 0
    assert_no_leak(reader)


@pytest.mark.parametrize("connector", ["offload", "example"])
def test_an_mla_latent_cache_round_trips_through_offload_and_example(connector: str, tmp_path: Path) -> None:
    config = offload_config(disk_dir=str(tmp_path)) if connector == "offload" else example_config(tmp_path)

    def mla_llm(kv_transfer_config: dict[str, Any] | None) -> LLM:
        return make_llm("bfloat16", kv_transfer_config, model=tiny_mla_model())

    reference = generate(mla_llm(None), PROMPTS)
    assert generate(mla_llm(config), PROMPTS) == reference
    reader = mla_llm(config)  # a fresh instance loads what the first stored
    assert generate(reader, PROMPTS) == reference
    stats = reader.engine.get_stats()
    assert stats["prompt_tokens_external"] > 0 and stats["kv_load_failures"] == 0
    assert_no_leak(reader)


def test_an_mla_latent_cache_round_trips_through_a_multi_connector(tmp_path: Path) -> None:
    children = [offload_config(cpu_bytes="4MiB"), example_config(tmp_path)]
    config = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": children}}
    writer = make_llm("auto", config, model=tiny_mla_model())
    first = generate(writer, PROMPTS)
    reader = make_llm("auto", config, model=tiny_mla_model())  # fresh: empty CPU tier, Example files remain
    assert generate(reader, PROMPTS) == first
    assert reader.engine.get_stats()["prompt_tokens_external"] > 0
    assert_no_leak(writer)
    assert_no_leak(reader)

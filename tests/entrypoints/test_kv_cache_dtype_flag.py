"""`--kv-cache-dtype` on generate, serve and up (vLLM's flag and values)."""

from __future__ import annotations

import pytest

from kvrelay.disagg.launcher_cli import serve_args_of
from kvrelay.entrypoints.cli import build_parser
from kvrelay.entrypoints.serve_cli import build_engine_config


def test_serve_flag_sets_the_cache_format() -> None:
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
    assert build_engine_config(args).cache.cache_dtype == "fp8_e4m3"
    assert build_engine_config(build_parser().parse_args(["serve"])).cache.cache_dtype == "auto"


def test_serve_refuses_an_unknown_format_naming_the_choices() -> None:
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "int4"])
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16"):
        build_engine_config(args)


def test_up_passes_one_format_to_every_instance() -> None:
    args = build_parser().parse_args(["up", "--kv-cache-dtype", "bf16"])
    assert serve_args_of(args)[-2:] == ["--kv-cache-dtype", "bfloat16"]
    assert "--kv-cache-dtype" not in serve_args_of(build_parser().parse_args(["up"]))
    with pytest.raises(ValueError, match="got 'fp7'"):
        serve_args_of(build_parser().parse_args(["up", "--kv-cache-dtype", "fp7"]))


def test_generate_has_the_flag() -> None:
    args = build_parser().parse_args(["generate", "hello", "--kv-cache-dtype", "float16"])
    assert args.kv_cache_dtype == "float16"

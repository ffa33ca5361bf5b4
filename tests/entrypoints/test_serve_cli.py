"""`kvrelay serve`'s HTTP settings: its keep-alive timeout is stated, and a flag changes it."""

from __future__ import annotations

import pytest
from fastapi import FastAPI

from kvrelay.entrypoints.cli import build_parser, main
from kvrelay.entrypoints.serve_cli import KEEP_ALIVE_S, uvicorn_config


def test_idle_connections_are_closed_after_uvicorn_and_vllm_s_five_seconds_unless_told_otherwise() -> None:
    default = build_parser().parse_args(["serve"])
    assert KEEP_ALIVE_S == 5 and uvicorn_config(FastAPI(), default).timeout_keep_alive == 5
    given = build_parser().parse_args(["serve", "--timeout-keep-alive", "30"])
    assert uvicorn_config(FastAPI(), given).timeout_keep_alive == 30


def test_a_keep_alive_under_one_second_is_refused_before_the_model_loads(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "/no/such/model.gguf", "--timeout-keep-alive", "0"]) == 2
    assert "--timeout-keep-alive must be at least 1 second, got 0" in capsys.readouterr().err

"""The session's vLLM fleet (fleet.py), started the first time a test asks for it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integrations.vllm.fleet import Fleet, started_fleet


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with started_fleet(tmp_path_factory.mktemp("vllm-fleet")) as started:
        yield started

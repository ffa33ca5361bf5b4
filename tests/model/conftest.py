"""Fixtures of the model tests."""

import pytest

from tests.model.kernels import ARCHS


@pytest.fixture(params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    """Each native kernel build target in turn (tests/model/kernels.py)."""
    return str(request.param)

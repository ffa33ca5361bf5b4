"""Fixtures and settings for the whole suite.

Without a GPU the Triton kernels run under Triton's interpreter: TRITON_INTERPRET is read when a
kernel is decorated (`@triton.jit`, at import), so it is set here, before any test module imports
kvrelay.kernels.triton. On a GPU machine the kernels compile as usual.
"""

import os

import pytest
import torch

from tests.kernels.builds import ARCHS

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    """Each native kernel build target in turn (tests/kernels/builds.py)."""
    return str(request.param)

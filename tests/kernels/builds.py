"""Getting the native kernels in tests: every build target, and a failed build that fails the test.

A test may skip only when a capability is truly absent: no C compiler on this machine, or a target
this CPU cannot build or run (haswell off x86-64, or on an x86-64 CPU without AVX2 and FMA). When
a compiler is present and a kernel does not build, `require_kernel` raises the compiler's error.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from typing import TypeVar

import pytest

from kvrelay.kernels import native

# Every target, whatever CPU runs the suite: native is what users get, haswell the AVX2 build an
# AVX2-only CPU (AMD Zen 3, Intel before Ice Lake) gets, generic the compiler's baseline.
ARCHS = ["native", "haswell", "generic"]

T = TypeVar("T")


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def skip_unless_buildable(arch: str) -> None:
    if native.c_compiler() is None:
        pytest.skip("no C compiler here: the native kernels cannot be built (torch is used)")
    if arch == "haswell" and not is_x86_64():
        pytest.skip(f"haswell is an x86-64 target; this machine is {platform.machine()}")


def skip_unless_runnable(arch: str) -> None:
    skip_unless_buildable(arch)
    if arch == "haswell" and not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("this x86-64 CPU has no AVX2/FMA: it cannot run the haswell build")


def require_kernel(kernel: str, arch: str, getter: Callable[[str], T | None]) -> T:
    """`getter(arch)` for a kernel this machine can build and run. A build failure raises
    KernelBuildError with the compiler's message: the test fails, it does not skip."""
    skip_unless_runnable(arch)
    native.build_kernel(kernel, arch)
    loaded = getter(arch)
    assert loaded is not None, f"{kernel} for {arch} built but did not load: see the log"
    return loaded

"""What a Triton kernel was launched with, and which compiled variant each launch selects.

Triton compiles one variant of a kernel per specialisation key: every constexpr's value, and for
each other argument its type plus what Triton specialises on (an int equal to 1 becomes a
constant, an int or a pointer divisible by 16 is marked so), unless the kernel opts out
(`do_not_specialize`, `do_not_specialize_on_alignment`). `variant_key` computes that key the way
Triton's launcher does, with Triton's own function, so tests can count the variants a sequence of
steps would compile, on the CPU under the interpreter as on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from triton.backends.compiler import BaseBackend
from triton.runtime import jit as triton_jit


@dataclass
class Launch:
    grid: tuple[int, ...]
    args: dict[str, Any]  # every parameter by name, and the launch options (num_warps)
    compiled: Any  # the compiled kernel on a GPU (None under the interpreter)


@contextlib.contextmanager
def recorded(monkeypatch: pytest.MonkeyPatch, kernel: Any) -> Iterator[list[Launch]]:
    """The launches of `kernel` inside the block (its `run`, as `kernel[grid](...)` calls it)."""
    launches: list[Launch] = []
    names = [p.name for p in kernel_params(kernel)]
    run = kernel.run

    def recording_run(*args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        compiled = run(*args, grid=grid, warmup=warmup, **kwargs)
        launches.append(Launch(tuple(grid), {**dict(zip(names, args, strict=False)), **kwargs}, compiled))
        return compiled

    with monkeypatch.context() as patch:
        patch.setattr(kernel, "run", recording_run)
        yield launches


def kernel_params(kernel: Any) -> list[Any]:
    """Triton's KernelParam list (name, constexpr, opt-outs) of a jitted or interpreted kernel."""
    if hasattr(kernel, "params"):
        return list(kernel.params)
    options = {k: kernel.kwargs.get(k) for k in ("do_not_specialize", "do_not_specialize_on_alignment")}
    return list(triton_jit.JITFunction(kernel.fn, **options).params)


def variant_key(kernel: Any, launch: Launch) -> tuple[Any, ...]:
    """The specialisation key Triton compiles `launch` under, with its num_warps."""
    key: list[Any] = []
    for p in kernel_params(kernel):
        value = launch.args.get(p.name, p.default)
        if p.is_constexpr:
            key.append(("constexpr", value))
        else:
            specialize, align = not p.do_not_specialize, not p.do_not_specialize_on_alignment
            key.append(triton_jit.native_specialize_impl(BaseBackend, value, p.is_const, specialize, align))
    key.append(("num_warps", launch.args.get("num_warps")))
    return tuple(key)

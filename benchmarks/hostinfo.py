"""The machine a benchmark ran on, as one line for the head of its table.

    cpu: AMD EPYC, 2 cores, sse4_2 avx avx2 fma avx512f avx512bw avx512_vnni avx512_bf16; torch: AVX512;
    native kernels: paged_decode, linear, elementwise (target native, 16-float vectors)

The kernel part says which build of kvrelay/kernels/native.py the run used (KVRELAY_NATIVE_ARCH
picks it), so a table from an AVX2-only machine, or with the AVX2 build forced, reads as such.
To stand in for an AVX2-only CPU on an AVX-512 one, lower torch and MKL too:
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 KVRELAY_NATIVE_ARCH=haswell python benchmarks/...
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The instruction sets that decide which kernels and which torch paths are fast, in this order.
_ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
              "amx_tile", "asimd", "sve")


def _cpuinfo() -> dict[str, str]:
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())  # the first CPU's entry
    except OSError:
        pass
    return fields


def cpu_summary() -> str:
    """Model name, cores this process may use, the ISA flags above that this CPU has, the vector
    code torch dispatches to (ATEN_CPU_CAPABILITY can lower it) and the native kernels in use
    (built here if need be)."""
    import torch  # only when a table is printed

    from kvrelay.kernels import native

    info = _cpuinfo()
    model = info.get("model name") or platform.processor() or platform.machine()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    isa = " ".join(f for f in _ISA_FLAGS if f in flags) or "unknown ISA"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"cpu: {model}, {cores} cores, {isa}; torch: {torch.backends.cpu.get_cpu_capability()}; "
            f"native kernels: {native.active_kernels()}")


if __name__ == "__main__":
    print(cpu_summary())

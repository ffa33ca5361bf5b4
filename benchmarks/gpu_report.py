"""Tables, failures and the machine line of bench_gpu.py.

A measurement that raises becomes a `Failure` cell ("FAILED: ...") with its traceback printed at
once, so one broken section never leaves a silent hole in a table or stops the others.
"""

from __future__ import annotations

import gc
import importlib.metadata
import os
import platform
import shutil
import subprocess
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Failure:
    what: str
    error: str  # "ExceptionType: message", first line

    def __str__(self) -> str:
        return f"FAILED: {self.error[:80]}"


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        lines = [f"### {self.title}", "", markdown_table(self.headers, self.rows)]
        if self.notes:
            lines += [""] + self.notes
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"title": self.title, "headers": self.headers, "rows": self.rows, "notes": self.notes}


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown table with columns padded to their widest cell (readable as plain text too)."""
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {row} has {len(row)} cells for {len(headers)} columns")
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in rows)])


class Section:
    """One section's tables, failures and wall time; `attempt` runs one measurement."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tables: list[Table] = []
        self.failures: list[dict[str, str]] = []
        self.notes: list[str] = []
        self.results: dict[str, Any] = {}  # what later tables (the summary) read
        self.seconds = 0.0

    def log(self, text: str) -> None:
        print(f"[{self.name}] {text}", flush=True)

    def attempt(self, what: str, fn: Callable[[], T]) -> T | Failure:
        """fn(), or a Failure whose traceback is printed now; the time it took is printed too."""
        start = time.monotonic()
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the run
            text = traceback.format_exc()
            first = (str(e).strip().splitlines() or [""])[0]
            self.log(f"{what}: FAILED after {time.monotonic() - start:.1f} s\n{text}")
            self.failures.append({"what": what, "error": f"{type(e).__name__}: {first}",
                                  "traceback": text})
            free_device_memory()
            return Failure(what, f"{type(e).__name__}: {first}")
        self.log(f"{what}: {describe(result)} ({time.monotonic() - start:.1f} s)")
        return result

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 1), "tables": [t.as_dict() for t in self.tables],
                "failures": self.failures, "notes": self.notes}


def describe(result: Any) -> str:
    if result is None:
        return "done"
    if hasattr(result, "tokens_per_s"):
        return f"{result.tokens_per_s:,.0f} tok/s"
    if hasattr(result, "share"):
        return f"{100 * result.share:.1f}% busy"
    return "done"


def free_device_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort after a failure
        pass


# ----------------------------------------------------------------------------- machine
def machine_lines(device: str, cpu_detail: bool) -> list[str]:
    """versions, the GPU (when `device` is one) and the CPU (hostinfo's detailed line when
    `cpu_detail`): the head of every table."""
    lines = [f"versions: {versions_line()}"]
    if device != "cpu":
        try:
            lines.append(gpu_line(device))
        except Exception as e:  # noqa: BLE001 - the tables matter more than this line
            lines.append(f"gpu: {device} (details unavailable: {type(e).__name__}: {e})")
    lines.append(cpu_summary() if cpu_detail else cpu_line())
    return lines


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cpu_line() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"cpu: {model}, {cores} cores"


def cpu_summary() -> str:
    """hostinfo's line (ISA, torch's vector code, the native kernels' build) where it can be had."""
    try:
        from hostinfo import cpu_summary as summary

        return summary()
    except Exception as e:  # noqa: BLE001 - the plain line will do
        return f"{cpu_line()} (hostinfo: {type(e).__name__}: {e})"


def gpu_line(device: str) -> str:
    import torch

    props = torch.cuda.get_device_properties(torch.device(device))
    driver = "unknown"
    if shutil.which("nvidia-smi"):
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=20).stdout.split("\n")[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return (f"gpu: {props.name}, {props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}, "
            f"CUDA {torch.version.cuda}, driver {driver or 'unknown'}")


def versions_line() -> str:
    import torch

    return (f"python {platform.python_version()}, torch {torch.__version__}, triton {version('triton')}, "
            f"transformers {version('transformers')}")

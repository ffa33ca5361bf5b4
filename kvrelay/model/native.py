"""Native CPU kernels: small C files next to this module, compiled on first use and called via ctypes.

Only one today: `paged_decode.c`, decode attention that reads K/V blocks in place. Plain torch has
no paged attention, so the torch route gathers every sequence's blocks into a padded copy first.
Whole decode steps with the kernel, against the same steps with the torch route, measured
1.19-1.24x faster at batch 1, 16 and 64 (benchmarks/bench_kernels.py).

The shared library is built once per machine with the system C compiler (`$CC`, else `cc`) into
`KVRELAY_CACHE_DIR/kernels/`, named by a hash of the source, the flags and the CPU, and written
atomically (several processes may build it at once). No compiler, a failed build or
`KVRELAY_NATIVE_KERNELS=0`: `paged_decode_kernel()` returns None and attention uses torch.

The library links OpenMP by soname (`libgomp.so.1`); torch has loaded its own copy under that name
by then, so the kernel runs on torch's thread pool, not a second one.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from kvrelay import env

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_decode.c")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

PagedDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], None]


def paged_decode_kernel() -> PagedDecode | None:
    """The compiled kernel as `fn(q, kv_cache, block_tables, seq_lens, out, scale)`, or None.

    q [n, H*D] float32 (rows may be strided, elements contiguous); kv_cache [num_blocks, 2, Hkv,
    bs, D] contiguous; block_tables [n, max_blocks] int64; seq_lens [n] int64 (each >= 1, covered
    by its table row); out [n, H*D] contiguous, overwritten. All on the CPU."""
    return _load_paged_decode() if env.native_kernels() else None


@functools.cache
def _load_paged_decode() -> PagedDecode | None:
    try:
        library = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("native paged decode kernel unavailable (%s); decode attention uses torch", exc)
        return None
    fn = library.paged_decode_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr,  # q, its row stride, kv, tables, lens, out, scratch
                   i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    fn.restype = None
    scratch_floats = library.paged_decode_scratch_floats
    scratch_floats.argtypes = [i64, i64, i64]  # num_heads, head_dim, block_size
    scratch_floats.restype = i64

    def paged_decode(
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        out: torch.Tensor,
        scale: float,
    ) -> None:
        _check_decode_args(q, kv_cache, block_tables, seq_lens, out)  # C trusts every pointer
        _, _, num_kv_heads, block_size, head_dim = kv_cache.shape
        num_seqs, max_blocks = block_tables.shape
        num_heads = out.shape[1] // head_dim
        threads = torch.get_num_threads()
        scratch = torch.empty(threads * scratch_floats(num_heads, head_dim, block_size), dtype=torch.float32)
        fn(q.data_ptr(), q.stride(0), kv_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
           out.data_ptr(), scratch.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size,
           max_blocks, scale, threads)

    return paged_decode


def _check_decode_args(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, out: torch.Tensor) -> None:
    """Raise ValueError, naming the argument, for a layout the C kernel would misread.
    NOTE: only structure (cheap, every call); the values (block ids inside the cache, lengths
    covered by the tables) are the caller's contract, checked once per step by attention.py."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be a contiguous [blocks, 2, Hkv, bs, D] tensor, "
                         f"got {tuple(kv_cache.shape)}")
    for name, t, dtype in (("q", q, torch.float32), ("kv_cache", kv_cache, torch.float32),
                           ("out", out, torch.float32), ("block_tables", block_tables, torch.int64),
                           ("seq_lens", seq_lens, torch.int64)):
        if t.dtype != dtype or t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU {dtype} tensor, got {t.dtype} on {t.device}")
    num_seqs = block_tables.shape[0]
    if (block_tables.dim() != 2 or not block_tables.is_contiguous() or not seq_lens.is_contiguous()
            or tuple(seq_lens.shape) != (num_seqs,) or q.shape[0] != num_seqs or out.shape != q.shape):
        raise ValueError(f"shapes disagree or are not contiguous: q {tuple(q.shape)}, "
                         f"out {tuple(out.shape)}, block_tables {tuple(block_tables.shape)}, "
                         f"seq_lens {tuple(seq_lens.shape)}")
    if q.stride(-1) != 1 or not out.is_contiguous() or q.shape[1] % kv_cache.shape[4]:
        raise ValueError(f"q rows must be contiguous and out contiguous, with H*D a multiple of "
                         f"{kv_cache.shape[4]}")


def _build() -> Path:
    """Compile `paged_decode.c` into the cache (once per source, flags and CPU); return its path."""
    compiler = os.environ.get("CC") or "cc"
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(_FLAGS).encode(), compiler.encode(), _cpu_id()]))
    target = env.cache_dir() / "kernels" / f"paged_decode-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"], capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            raise OSError(f"{compiler} exited with {done.returncode}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)  # atomic: a concurrent builder's identical file may win, that is fine
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _cpu_id() -> bytes:
    """What `-march=native` depends on: the machine and its CPU feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return f"{platform.machine()}|{flags}".encode()

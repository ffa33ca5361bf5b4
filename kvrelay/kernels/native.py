"""Native CPU kernels: small C files next to this module, compiled on first use and called via ctypes.

- `paged_decode.c`: decode attention that reads K/V blocks in place, in any KV cache format
  (float32, bfloat16, float16, fp8), widening each element in registers. Plain torch has no paged
  attention, so the torch route gathers every sequence's blocks into a padded copy first.
- `linear.c`: x . W^T for a few rows (decode batches), where MKL runs far under the machine's
  limits. See `kvrelay/model/layers.py` for when it is used.
- `elementwise.c`: residual add + RMSNorm, SiLU-and-multiply, rotary embedding and the KV cache
  write, each one call instead of several torch operators.
`simd.h` holds the vector helpers they share; its vectors are as wide as the target's registers
(16 floats with AVX-512, 8 with AVX2, 4 otherwise), so one source serves every CPU.
Whole decode steps with the kernels against the same steps without them: benchmarks/bench_kernels.py.

Build target (`KVRELAY_NATIVE_ARCH`, or the `arch` argument of the getters):
  native    `-march=native`: every feature of this CPU (the default)
  haswell   `-march=haswell`: AVX2 + FMA, no AVX-512 (x86-64 only); what an AVX2-only CPU runs
  generic   no `-march` at all: the compiler's baseline (SSE2 on x86-64), for any other compiler
Each shared library is built once per target and machine with the system C compiler (`$CC`, else
`cc`) into `KVRELAY_CACHE_DIR/kernels/`, named by a hash of the source, the flags and the CPU, and
written atomically (several processes may build it at once).

When a kernel is unavailable the getters return None and callers use torch: with
`KVRELAY_NATIVE_KERNELS=0`, or with no C compiler (a warning). A compiler that rejects a kernel is a
bug, not a missing capability: it is logged as an error with the compiler's message, and
`build_kernel` raises it (the tests call that, so they fail instead of falling back).

The libraries link OpenMP by soname (`libgomp.so.1`); torch has loaded its own copy under that
name by then, so the kernels run on torch's thread pool, not a second one.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvrelay import env

logger = logging.getLogger(__name__)

KERNELS = ("paged_decode", "linear", "elementwise")  # each a C file beside this module
_HEADER = Path(__file__).with_name("simd.h")  # included by every source
_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
_ARCH_FLAGS = {"native": ("-march=native",), "haswell": ("-march=haswell",), "generic": ()}
assert set(_ARCH_FLAGS) == set(env.NATIVE_ARCHS)


class KernelUnavailable(RuntimeError):
    """A native kernel cannot be had here; the message says why."""


class NoCompilerError(KernelUnavailable):
    """No C compiler on this machine: the kernels cannot exist here, torch is used instead."""


class KernelBuildError(KernelUnavailable):
    """A C compiler exists but did not build a kernel: the message holds its error."""

PagedDecode = Callable[..., None]

# KV cache element types paged_decode.c reads (its KV_* constants).
_KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3,
             torch.float8_e5m2: 4}


def paged_decode_kernel(arch: str | None = None) -> PagedDecode | None:
    """The compiled kernel as `fn(q, kv_cache, block_tables, seq_lens, out, scale, kv_scales=None)`,
    or None.

    q [n, H*D] float32 (rows may be strided, elements contiguous); kv_cache [num_blocks, 2, Hkv,
    bs, D] contiguous, float32, bfloat16, float16, float8_e4m3fn or float8_e5m2, read as it is
    stored; kv_scales [2, Hkv] float32 (K then V scales: the cache holds value / scale), required
    for fp8 and refused otherwise; block_tables [n, max_blocks] int64; seq_lens [n] int64 (each
    >= 1, covered by its table row); out [n, H*D] float32 contiguous, overwritten. All on the
    CPU. `arch`: the build target (module docstring), default `KVRELAY_NATIVE_ARCH`."""
    return _load_paged_decode(arch or env.native_arch()) if env.native_kernels() else None


@functools.cache
def _load_paged_decode(arch: str) -> PagedDecode | None:
    library = _library_or_none("paged_decode", arch, "decode attention uses torch")
    if library is None:
        return None
    fn = library.paged_decode
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    # q, its row stride, kv, kind, kv_scales, tables, lens, out, scratch
    fn.argtypes = [ptr, i64, ptr, ctypes.c_int, ptr, ptr, ptr, ptr, ptr,
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
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        _check_decode_args(q, kv_cache, block_tables, seq_lens, out, kv_scales)  # C trusts every pointer
        _, _, num_kv_heads, block_size, head_dim = kv_cache.shape
        num_seqs, max_blocks = block_tables.shape
        num_heads = out.shape[1] // head_dim
        threads = torch.get_num_threads()
        scratch = torch.empty(threads * scratch_floats(num_heads, head_dim, block_size), dtype=torch.float32)
        fn(q.data_ptr(), q.stride(0), kv_cache.data_ptr(), _KV_KINDS[kv_cache.dtype],
           None if kv_scales is None else kv_scales.data_ptr(), block_tables.data_ptr(),
           seq_lens.data_ptr(), out.data_ptr(), scratch.data_ptr(), num_seqs, num_heads, num_kv_heads,
           head_dim, block_size, max_blocks, scale, threads)

    return paged_decode


def _check_decode_args(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, out: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    """Raise ValueError, naming the argument, for a layout the C kernel would misread.
    NOTE: only structure (cheap, every call); the values (block ids inside the cache, lengths
    covered by the tables) are the caller's contract, checked once per step by attention.py."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be a contiguous [blocks, 2, Hkv, bs, D] tensor, "
                         f"got {tuple(kv_cache.shape)}")
    if kv_cache.dtype not in _KV_KINDS or kv_cache.device.type != "cpu":
        raise ValueError(f"kv_cache must be a CPU tensor of {', '.join(map(str, _KV_KINDS))}, "
                         f"got {kv_cache.dtype} on {kv_cache.device}")
    for name, t, dtype in (("q", q, torch.float32), ("out", out, torch.float32),
                           ("block_tables", block_tables, torch.int64), ("seq_lens", seq_lens, torch.int64)):
        if t.dtype != dtype or t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU {dtype} tensor, got {t.dtype} on {t.device}")
    _check_kv_scales(kv_cache, kv_scales)
    num_seqs = block_tables.shape[0]
    if (block_tables.dim() != 2 or not block_tables.is_contiguous() or not seq_lens.is_contiguous()
            or tuple(seq_lens.shape) != (num_seqs,) or q.shape[0] != num_seqs or out.shape != q.shape):
        raise ValueError(f"shapes disagree or are not contiguous: q {tuple(q.shape)}, "
                         f"out {tuple(out.shape)}, block_tables {tuple(block_tables.shape)}, "
                         f"seq_lens {tuple(seq_lens.shape)}")
    if q.stride(-1) != 1 or not out.is_contiguous() or q.shape[1] % kv_cache.shape[4]:
        raise ValueError(f"q rows must be contiguous and out contiguous, with H*D a multiple of "
                         f"{kv_cache.shape[4]}")


def _check_kv_scales(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    is_fp8 = kv_cache.element_size() == 1
    if kv_scales is None:
        if is_fp8:
            raise ValueError(f"an {kv_cache.dtype} KV cache needs kv_scales [2, Hkv]")
        return
    if not is_fp8:
        raise ValueError(f"kv_scales apply to fp8 KV caches only, got a {kv_cache.dtype} cache")
    if (kv_scales.dtype != torch.float32 or kv_scales.device.type != "cpu" or not kv_scales.is_contiguous()
            or tuple(kv_scales.shape) != (2, kv_cache.shape[2])):
        raise ValueError(f"kv_scales must be a contiguous CPU float32 [2, {kv_cache.shape[2]}] tensor, got "
                         f"{tuple(kv_scales.shape)} {kv_scales.dtype}")


class NativeLinear:
    """`linear.c` as a callable: `kernel(x, weight, bias)` -> x . weight^T (+ bias), a new tensor.

    x [M, K] float32 (rows may be strided, elements contiguous), weight [N, K] contiguous float32,
    bias [N] or None, all on the CPU, with K a multiple of 16 and N of 4; `fits` says whether
    arguments are of that form, and a call with any others raises ValueError (C trusts every
    pointer)."""

    def __init__(self, fn: Any) -> None:
        self._fn = fn

    @staticmethod
    def fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        if x.dim() != 2 or weight.dim() != 2:
            return False
        out_features, in_features = weight.shape
        return (x.dtype == torch.float32 and weight.dtype == torch.float32
                and x.device.type == "cpu" and weight.device.type == "cpu"
                and x.shape[1] == in_features and in_features % 16 == 0 and out_features % 4 == 0
                and x.stride(1) == 1 and weight.is_contiguous()
                and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu"
                                      and bias.is_contiguous() and tuple(bias.shape) == (out_features,))))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.fits(x, weight, bias):
            raise ValueError(
                f"native linear needs float32 CPU tensors, x [M, K] with contiguous rows, a contiguous "
                f"weight [N, K] with K % 16 == 0 and N % 4 == 0, bias [N] or None; got x "
                f"{tuple(x.shape)} {x.dtype} stride {x.stride()}, weight {tuple(weight.shape)} "
                f"{weight.dtype}, bias {None if bias is None else tuple(bias.shape)}")
        num_rows = x.shape[0]
        out_features, in_features = weight.shape
        out = torch.empty(num_rows, out_features, dtype=torch.float32)
        self._fn(x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                 out.data_ptr(), num_rows, out_features, in_features, torch.get_num_threads())
        return out


def linear_kernel(arch: str | None = None) -> NativeLinear | None:
    """The compiled `linear.c` for `arch` (default `KVRELAY_NATIVE_ARCH`), or None (see the
    module docstring)."""
    return _load_linear(arch or env.native_arch()) if env.native_kernels() else None


@functools.cache
def _load_linear(arch: str) -> NativeLinear | None:
    library = _library_or_none("linear", arch, "linear layers use torch only")
    if library is None:
        return None
    fn = library.linear_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    # x, its row stride, weight, bias, y, M, N, K, threads
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
    fn.restype = None
    return NativeLinear(fn)


class Elementwise:
    """`elementwise.c` as methods. Each checks the layout the C code relies on (cheaply: these run
    ~5 times per layer per step) and raises ValueError, naming the argument, for any other."""

    def __init__(self, library: Any) -> None:
        i64, ptr, f32, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
        self._add_rms_norm = library.add_rms_norm_f32
        self._add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, f32, c_int]
        self._silu_mul = library.silu_mul_f32
        self._silu_mul.argtypes = [ptr, ptr, i64, i64, c_int]
        self._rotary = library.rotary_f32
        self._rotary.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, c_int]
        self._write_kv = library.write_kv_f32
        self._write_kv.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64]
        for fn in (self._add_rms_norm, self._silu_mul, self._rotary, self._write_kv):
            fn.restype = None

    def add_rms_norm(self, h: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """residual += h (in place; skipped when h is None), then RMSNorm(residual) * weight into a
        new tensor. residual and h [M, D], weight [D], all contiguous float32 on the CPU."""
        _need_f32("residual", residual, contiguous=True)
        _need_f32("weight", weight, contiguous=True)
        rows, width = residual.shape if residual.dim() == 2 else (-1, -1)
        if rows < 0 or tuple(weight.shape) != (width,):
            raise ValueError(f"residual must be [M, D] and weight [D], got {tuple(residual.shape)} "
                             f"and {tuple(weight.shape)}")
        if h is not None:
            _need_f32("h", h, contiguous=True)
            if h.shape != residual.shape:
                raise ValueError(f"h {tuple(h.shape)} and residual {tuple(residual.shape)} differ in shape")
        out = torch.empty_like(residual)
        self._add_rms_norm(None if h is None else h.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                           out.data_ptr(), rows, width, eps, torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [M, 2I] contiguous float32 -> silu(gate) * up, [M, I]."""
        _need_f32("gate_up", gate_up, contiguous=True)
        if gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError(f"gate_up must be [M, 2I], got {tuple(gate_up.shape)}")
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
        return out

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotates x [T, heads, D] in place (rows any stride, heads and D contiguous within a row)
        by cos and sin as `RotaryEmbedding.cos_sin` makes them ([T, 1, D] contiguous)."""
        _need_f32("x", x, contiguous=False)
        _need_f32("cos", cos, contiguous=True)
        _need_f32("sin", sin, contiguous=True)
        if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2] or x.shape[2] % 2:
            raise ValueError(f"x must be [T, heads, D] with heads and D contiguous and D even, got "
                             f"shape {tuple(x.shape)} stride {x.stride()}")
        tokens, heads, dim = x.shape
        if cos.shape != (tokens, 1, dim) or sin.shape != (tokens, 1, dim):
            raise ValueError(f"cos and sin must be [{tokens}, 1, {dim}], got {tuple(cos.shape)} "
                             f"and {tuple(sin.shape)}")
        self._rotary(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), tokens, heads, dim,
                     torch.get_num_threads())

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        """cache [num_blocks, 2, Hkv, bs, D] contiguous; k, v [T, Hkv*D] with contiguous rows;
        slots [T] int64, each in [0, num_blocks * bs): the caller checks the values (once per
        step), this only the layout."""
        _need_f32("k", k, contiguous=False)
        _need_f32("v", v, contiguous=False)
        _need_f32("cache", cache, contiguous=True)
        if cache.dim() != 5 or cache.shape[1] != 2:
            raise ValueError(f"cache must be [blocks, 2, Hkv, bs, D], got {tuple(cache.shape)}")
        _, _, num_kv_heads, block_size, head_dim = cache.shape
        tokens = k.shape[0] if k.dim() == 2 else -1
        if (tokens < 0 or k.shape != (tokens, num_kv_heads * head_dim) or v.shape != k.shape
                or k.stride(1) != 1 or v.stride(1) != 1):
            raise ValueError(f"k and v must be [T, {num_kv_heads * head_dim}] with contiguous rows, got "
                             f"{tuple(k.shape)} stride {k.stride()} and {tuple(v.shape)} stride {v.stride()}")
        if slots.dtype != torch.int64 or slots.device.type != "cpu" or not slots.is_contiguous() \
                or tuple(slots.shape) != (tokens,):
            raise ValueError(f"slots must be a contiguous CPU int64 [{tokens}] tensor, got "
                             f"{tuple(slots.shape)} {slots.dtype}")
        self._write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), cache.data_ptr(),
                       slots.data_ptr(), tokens, num_kv_heads, block_size, head_dim)


def _need_f32(name: str, t: torch.Tensor, contiguous: bool) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or (contiguous and not t.is_contiguous()):
        raise ValueError(f"{name} must be a {'contiguous ' if contiguous else ''}CPU float32 tensor, "
                         f"got {t.dtype} on {t.device}{'' if t.is_contiguous() else ', not contiguous'}")


def elementwise_kernels(arch: str | None = None) -> Elementwise | None:
    """The compiled `elementwise.c` for `arch` (default `KVRELAY_NATIVE_ARCH`), or None (see the
    module docstring)."""
    return _load_elementwise(arch or env.native_arch()) if env.native_kernels() else None


@functools.cache
def _load_elementwise(arch: str) -> Elementwise | None:
    library = _library_or_none("elementwise", arch, "layers use torch operators")
    return None if library is None else Elementwise(library)


# ----------------------------------------------------------------------------- building
def c_compiler() -> list[str] | None:
    """The C compiler command (`$CC`, else `cc`) as an argument list, or None when not installed."""
    command = shlex.split(os.environ.get("CC") or "cc")
    return command if command and shutil.which(command[0]) else None


def build_kernel(kernel: str, arch: str) -> Path:
    """Compile `kernel` (one of KERNELS) for `arch` into the cache, once per source, flags and CPU;
    return the library's path. Raises NoCompilerError or KernelBuildError (with the compiler's
    error), ValueError for an unknown name."""
    if kernel not in KERNELS or arch not in _ARCH_FLAGS:
        raise ValueError(f"unknown native kernel {kernel!r} or target {arch!r}: kernels are {KERNELS}, "
                         f"targets {tuple(_ARCH_FLAGS)}")
    compiler = c_compiler()
    if compiler is None:
        raise NoCompilerError(f"no C compiler: {os.environ.get('CC') or 'cc'!r} is not installed (set CC)")
    source_path = Path(__file__).with_name(f"{kernel}.c")
    flags = (*_FLAGS, *_ARCH_FLAGS[arch])
    source = source_path.read_bytes() + _HEADER.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join([*compiler, *flags]).encode(), _cpu_id()]))
    target = env.cache_dir() / "kernels" / f"{kernel}-{arch}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        command = [*compiler, *flags, str(source_path), "-o", tmp, "-lm"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            raise KernelBuildError(f"{' '.join(command)} failed to run: {exc}") from exc
        if done.returncode != 0:
            hint = " (KVRELAY_NATIVE_ARCH=generic builds without -march)" if arch != "generic" else ""
            raise KernelBuildError(f"{' '.join(command)} exited with {done.returncode}{hint}:\n"
                                   f"{done.stderr.strip()[-3000:]}")
        os.replace(tmp, target)  # atomic: a concurrent builder's identical file may win, that is fine
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _library_or_none(kernel: str, arch: str, fallback: str) -> ctypes.CDLL | None:
    """The loaded library, or None with the reason logged: a warning without a compiler, an error
    (with the compiler's message) when one is there and failed."""
    try:
        return ctypes.CDLL(str(build_kernel(kernel, arch)))
    except NoCompilerError as exc:
        logger.warning("native %s kernel unavailable (%s); %s", kernel, exc, fallback)
    except (KernelBuildError, OSError) as exc:
        logger.error("native %s kernel for target %r did not build or load; %s. This is a bug, please "
                     "report it: %s", kernel, arch, fallback, exc)
    return None


def _cpu_id() -> bytes:
    """What `-march=native` depends on: the machine and its CPU feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return f"{platform.machine()}|{flags}".encode()


# ----------------------------------------------------------------------------- what is active
def active_kernels(arch: str | None = None) -> str:
    """One line for logs and benchmark tables: which native kernels are in use and how they were
    built, e.g. "paged_decode, linear, elementwise (target native, 16-float vectors)". Builds
    them if need be (the first step would)."""
    if not env.native_kernels():
        return "none (KVRELAY_NATIVE_KERNELS=0): torch everywhere"
    arch = arch or env.native_arch()
    getters: dict[str, Callable[[str], object]] = {
        "paged_decode": paged_decode_kernel, "linear": linear_kernel, "elementwise": elementwise_kernels}
    active = [name for name, getter in getters.items() if getter(arch) is not None]
    if not active:
        return f"none (target {arch}: see the log for why): torch everywhere"
    widths = sorted({ctypes.CDLL(str(build_kernel(name, arch))).kvrelay_vector_floats() for name in active})
    inactive = [name for name in getters if name not in active]
    return (f"{', '.join(active)} (target {arch}, {'/'.join(map(str, widths))}-float vectors)"
            + (f"; torch for {', '.join(inactive)}" if inactive else ""))


def numerics_target(arch: str | None = None) -> str:
    """What decides the native kernels' bits on this machine, for the batch-invariant mode's
    compatibility digest: the reductions' lanes and fused multiply-adds of the build for `arch`
    (default `KVRELAY_NATIVE_ARCH`), the compiler, and a digest of the kernels' sources, e.g.
    "16-lane fma; cc (Debian 14.2.0-19) 14.2.0; src 3f2a9c1b". Raises KernelUnavailable when a
    kernel cannot be had (the mode has no other route on the CPU)."""
    arch = arch or env.native_arch()
    if not env.native_kernels():
        raise KernelUnavailable("KVRELAY_NATIVE_KERNELS=0")
    targets = {ctypes_target(build_kernel(name, arch)) for name in KERNELS}
    sources = hashlib.sha256(b"".join(Path(__file__).with_name(f"{name}.c").read_bytes() for name in KERNELS)
                             + _HEADER.read_bytes()).hexdigest()[:8]
    return f"{'/'.join(sorted(targets))}; {_compiler_version()}; src {sources}"


def ctypes_target(library_path: Path) -> str:
    """`kvrelay_simd_target()` of a built library."""
    fn = ctypes.CDLL(str(library_path)).kvrelay_simd_target
    fn.restype = ctypes.c_char_p
    return bytes(fn()).decode()


@functools.cache
def _compiler_version() -> str:
    compiler = c_compiler()
    if compiler is None:
        return "no compiler"
    try:
        done = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{compiler[0]} (version unknown: {exc})"
    lines = done.stdout.strip().splitlines()
    return lines[0] if lines else compiler[0]


def log_active_kernels(device: torch.device) -> None:
    """Logs `active_kernels()` once per process (and per answer) when the model runs on the CPU."""
    if device.type == "cpu":
        _log_once(f"native CPU kernels: {active_kernels()}")


@functools.cache
def _log_once(line: str) -> None:
    logger.info(line)

"""The native kernels of kvrelay/kernels/native.py against torch: linear.c and elementwise.c, each
for every build target (the `arch` fixture: native, haswell = AVX2 without AVX-512, generic),
whatever CPU runs the suite; and the build itself: targets, failures, the start-up line.
(paged_decode.c is tested with attention, in test_attention.py.)"""

import logging
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvrelay import env
from kvrelay.kernels import native
from kvrelay.model.layers import RotaryEmbedding, apply_rotary
from tests.kernels.builds import cpu_flags, require_kernel, skip_unless_buildable


def linear_for(arch: str) -> native.NativeLinear:
    return require_kernel("linear", arch, native.linear_kernel)


def elementwise_for(arch: str) -> native.Elementwise:
    return require_kernel("elementwise", arch, native.elementwise_kernels)


# ----------------------------------------------------------------------------- linear.c
@pytest.mark.parametrize("num_rows", [1, 2, 5, 6, 7, 13, 64, 301])
@pytest.mark.parametrize(("out_features", "in_features"), [(4, 16), (96, 64), (200, 2048)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_linear_equals_f_linear(num_rows: int, out_features: int, in_features: int,
                                       with_bias: bool, arch: str) -> None:
    """Row counts on and off the 6-row tile, one tile of weight rows, and (200 x 2048) several
    cache blocks per thread, the last one partial, split unevenly between two threads."""
    kernel = linear_for(arch)
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features)
    bias = torch.randn(out_features) if with_bias else None
    x = torch.randn(num_rows, in_features)
    out = kernel(x, weight, bias)
    assert out.shape == (num_rows, out_features) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("in_features", [48, 576])
def test_native_linear_gives_a_row_the_same_bits_alone_or_in_a_batch(in_features: int, arch: str) -> None:
    """1-2 rows take their own weight-streaming loop; it sums in the tiles' order, so a sequence's
    logits do not depend on how many others share its decode step."""
    kernel = linear_for(arch)
    torch.manual_seed(0)
    weight, bias = torch.randn(40, in_features), torch.randn(40)
    x = torch.randn(7, in_features)
    batch = kernel(x, weight, bias)
    assert torch.equal(kernel(x[:1], weight, bias), batch[:1])
    assert torch.equal(kernel(x[3:5], weight, bias), batch[3:5])
    wide = torch.randn(2, 2 * in_features)  # two strided rows
    assert torch.equal(kernel(wide[:, :in_features], weight, bias),
                       kernel(wide[:, :in_features].contiguous(), weight, bias))


@pytest.mark.parametrize("threads", [1, 3])
def test_native_linear_splits_rows_over_any_thread_count(threads: int, arch: str) -> None:
    kernel = linear_for(arch)
    torch.manual_seed(0)
    weight, x = torch.randn(44, 32), torch.randn(9, 32)  # 11 tiles of 4 rows: no even split
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernel(x, weight, None)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_native_linear_reads_strided_rows(arch: str) -> None:
    kernel = linear_for(arch)
    torch.manual_seed(0)
    wide = torch.randn(10, 96)
    x = wide[:, 16:80]  # [10, 64], row stride 96
    weight = torch.randn(8, 64)
    torch.testing.assert_close(kernel(x, weight, None), F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_native_linear_refuses_what_it_would_misread() -> None:
    kernel = linear_for("native")
    x, weight, bias = torch.zeros(3, 32), torch.zeros(8, 32), torch.zeros(8)
    kernel(x, weight, bias)  # well formed: runs
    bad = {
        "in_features not a multiple of 16": (torch.zeros(3, 40), torch.zeros(8, 40), None),
        "out_features not a multiple of 4": (x, torch.zeros(6, 32), None),
        "float64 x": (x.double(), weight, None),
        "transposed weight": (x, torch.zeros(32, 8).t(), None),
        "strided elements": (torch.zeros(3, 64)[:, ::2], weight, None),
        "bias of the wrong length": (x, weight, torch.zeros(4)),
        "inner sizes disagree": (torch.zeros(3, 16), weight, None),
    }
    for what, args in bad.items():
        assert not kernel.fits(*args), what
        with pytest.raises(ValueError, match="native linear needs float32 CPU tensors"):
            kernel(*args)

# ----------------------------------------------------------------------------- elementwise.c
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 crosses the threshold for threads
@pytest.mark.parametrize("with_h", [True, False])
def test_add_rms_norm_adds_in_place_and_normalises(rows: int, with_h: bool, arch: str) -> None:
    kernels = elementwise_for(arch)
    torch.manual_seed(0)
    residual, h, weight = torch.randn(rows, 576), torch.randn(rows, 576), torch.randn(576)
    expected_sum = residual + h if with_h else residual.clone()
    out = kernels.add_rms_norm(h if with_h else None, residual, weight, 1e-5)
    torch.testing.assert_close(residual, expected_sum)  # the stream moved on, in place
    torch.testing.assert_close(out, F.rms_norm(expected_sum, (576,), weight, 1e-5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("width", [3, 40, 1536])  # a scalar tail only, vectors and a tail, vectors
def test_silu_mul_matches_torch_over_both_signs_and_large_values(width: int, arch: str) -> None:
    kernels = elementwise_for(arch)
    torch.manual_seed(0)
    gate_up = torch.randn(130, 2 * width) * 8  # 130 rows x 1536: the threaded path too
    gate_up[0, :width] = torch.linspace(-200, 200, width)  # far beyond exp's range on both sides
    expected = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    torch.testing.assert_close(kernels.silu_mul(gate_up), expected, atol=1e-5, rtol=1e-5)


def test_rotary_in_place_matches_torch_on_strided_rows(arch: str) -> None:
    kernels = elementwise_for(arch)
    torch.manual_seed(0)
    rope = RotaryEmbedding(64, 10000.0, None)
    cos, sin = rope.cos_sin(torch.arange(9) * 37, torch.float32)
    qkv = torch.randn(9, (4 + 2 + 2) * 64)
    qk = qkv[:, : 6 * 64].view(9, 6, 64)  # q and k heads of each row, v left after them
    expected, v_before = apply_rotary(qk, cos, sin), qkv[:, 6 * 64 :].clone()
    kernels.rotary_(qk, cos, sin)
    torch.testing.assert_close(qk, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, 6 * 64 :], v_before)  # v untouched


def test_write_kv_puts_each_token_in_its_slot_and_nothing_else(arch: str) -> None:
    kernels = elementwise_for(arch)
    torch.manual_seed(0)
    cache = torch.zeros(6, 2, 2, 4, 16)  # 6 blocks, 2 KV heads, block size 4, head dim 16
    kv = torch.randn(3, 3 * 32)  # rows hold [q | k | v], as a qkv projection does
    k, v = kv[:, 32:64], kv[:, 64:]
    slots = torch.tensor([0, 13, 23])  # block 0 offset 0, block 3 offset 1, block 5 offset 3
    kernels.write_kv(k, v, cache, slots)
    expected = torch.zeros_like(cache)
    for t, slot in enumerate(slots.tolist()):
        expected[slot // 4, 0, :, slot % 4] = k[t].view(2, 16)
        expected[slot // 4, 1, :, slot % 4] = v[t].view(2, 16)
    assert torch.equal(cache, expected)


def test_elementwise_kernels_refuse_what_they_would_misread() -> None:
    kernels = elementwise_for("native")
    x, w = torch.zeros(4, 32), torch.zeros(32)
    cos, sin = torch.zeros(4, 1, 16), torch.zeros(4, 1, 16)
    cache, slots = torch.zeros(2, 2, 1, 4, 16), torch.zeros(4, dtype=torch.int64)
    cases = [
        (lambda: kernels.add_rms_norm(x, x.double(), w, 1e-5), "residual must be a contiguous CPU float32"),
        (lambda: kernels.add_rms_norm(x, torch.zeros(32, 4).t(), w, 1e-5), "not contiguous"),
        (lambda: kernels.add_rms_norm(x[:2], x, w, 1e-5), "differ in shape"),
        (lambda: kernels.add_rms_norm(None, x, w[:8], 1e-5), "weight \\[D\\]"),
        (lambda: kernels.silu_mul(torch.zeros(4, 31)), "gate_up must be \\[M, 2I\\]"),
        (lambda: kernels.rotary_(torch.zeros(4, 2, 16)[:, :, ::2], cos, sin), "x must be \\[T, heads, D\\]"),
        (lambda: kernels.rotary_(torch.zeros(4, 2, 16), cos[:3], sin[:3]), "cos and sin must be"),
        (lambda: kernels.write_kv(x[:, :16], x[:, 16:], cache, slots[:3]), "slots must be"),
        (lambda: kernels.write_kv(x[:, :16], x[:, :8], cache, slots), "k and v must be"),
        (lambda: kernels.write_kv(x[:, :16], x[:, 16:], cache[:, 0], slots), "cache must be"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_elementwise_off_or_without_compiler_is_none(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("KVRELAY_NATIVE_KERNELS", "0")
    assert native.elementwise_kernels() is None
    assert "torch everywhere" in native.active_kernels()
    monkeypatch.setenv("KVRELAY_NATIVE_KERNELS", "1")
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    native._load_elementwise.cache_clear()
    try:
        assert native.c_compiler() is None
        with caplog.at_level("WARNING"):
            assert native.elementwise_kernels() is None
        assert "no C compiler" in caplog.text and "layers use torch operators" in caplog.text
        with pytest.raises(native.NoCompilerError, match="no-such-compiler"):
            native.build_kernel("elementwise", "native")
    finally:
        native._load_elementwise.cache_clear()


def test_a_compiler_that_fails_is_an_error_with_its_message_not_a_silent_fallback(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho \"linear.c:60: error: impossible constraint in 'asm'\" >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(broken))
    native._load_linear.cache_clear()
    try:
        with pytest.raises(native.KernelBuildError, match="impossible constraint"):
            native.build_kernel("linear", "haswell")  # what the tests call: they fail, not skip
        with caplog.at_level("ERROR"):
            assert native.linear_kernel("haswell") is None  # serving goes on with torch, loudly
        [record] = [r for r in caplog.records if r.name == native.__name__]
        assert record.levelno == logging.ERROR
        assert "impossible constraint" in record.getMessage() and "'haswell'" in record.getMessage()
    finally:
        native._load_linear.cache_clear()


def test_unknown_target_or_kernel_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRELAY_NATIVE_ARCH", "skylake")
    with pytest.raises(ValueError, match="KVRELAY_NATIVE_ARCH must be one of native, haswell, generic, "
                                         "got 'skylake'"):
        native.linear_kernel()
    monkeypatch.setenv("KVRELAY_NATIVE_ARCH", " Haswell ")
    assert env.native_arch() == "haswell"
    with pytest.raises(ValueError, match="unknown native kernel 'gemm'"):
        native.build_kernel("gemm", "native")


def test_each_target_builds_every_kernel_with_its_vector_width(arch: str) -> None:
    """haswell: 8-float vectors (AVX2) on any x86-64 host, AVX-512 or not; generic: the compiler's
    baseline (4 floats: SSE2 on x86-64); native: 16 floats where this CPU has AVX-512."""
    for kernel, getter in (("paged_decode", native.paged_decode_kernel), ("linear", native.linear_kernel),
                           ("elementwise", native.elementwise_kernels)):
        require_kernel(kernel, arch, getter)
    line = native.active_kernels(arch)
    assert line.startswith(f"paged_decode, linear, elementwise (target {arch}, "), line
    expected = {"haswell": 8, "generic": 4, "native": 16 if "avx512f" in cpu_flags() else None}[arch]
    if expected is not None and (arch != "generic" or "sse2" in cpu_flags()):
        assert f"{expected}-float vectors" in line, line


@pytest.mark.parametrize("arch", ["haswell", "generic"])
def test_non_avx512_builds_hold_no_avx512_instruction(arch: str) -> None:
    """What an AVX2-only CPU runs must not touch a zmm register (nor a ymm one, for generic): an
    AVX-512 instruction there is SIGILL. Checked on the machine code, whatever this CPU is."""
    skip_unless_buildable(arch)
    if arch == "generic" and "sse2" not in cpu_flags():
        pytest.skip("generic is checked for x86-64 registers; this machine is not x86-64")
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump here to read the machine code")
    for kernel in native.KERNELS:
        code = subprocess.run([objdump, "-d", str(native.build_kernel(kernel, arch))], capture_output=True,
                              text=True, check=True).stdout
        assert "%xmm" in code or "%ymm" in code, f"{kernel}: no vector code at all?"
        assert "%zmm" not in code, f"{kernel} built for {arch} uses AVX-512 registers"
        if arch == "generic":
            assert "%ymm" not in code, f"{kernel} built for generic x86-64 uses AVX registers"


def test_native_build_keeps_avx512_where_the_cpu_has_it() -> None:
    skip_unless_buildable("native")
    objdump = shutil.which("objdump")
    if "avx512f" not in cpu_flags() or objdump is None:
        pytest.skip("this CPU has no AVX-512 (or no objdump here to read the machine code)")
    code = subprocess.run([objdump, "-d", str(native.build_kernel("linear", "native"))], capture_output=True,
                          text=True, check=True).stdout
    assert "%zmm" in code


def test_start_up_line_names_the_active_kernels_once(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("KVRELAY_NATIVE_ARCH", "generic")
    require_kernel("linear", "generic", native.linear_kernel)
    native._log_once.cache_clear()
    with caplog.at_level("INFO", logger=native.__name__):
        for _ in range(3):
            native.log_active_kernels(torch.device("cpu"))
        native.log_active_kernels(torch.device("meta"))  # not a CPU model: nothing to say
    [record] = caplog.records
    assert record.getMessage().startswith("native CPU kernels: paged_decode, linear, elementwise "
                                          "(target generic, ")

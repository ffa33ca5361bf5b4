from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvrelay.kernels import native
from kvrelay.model import layers
from kvrelay.model.layers import Linear, linear
from tests.kernels.builds import require_kernel


@pytest.mark.parametrize("num_tokens", [1, 3, 64, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_f_linear(num_tokens: int, with_bias: bool) -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 40)
    bias = torch.randn(96) if with_bias else None
    x = torch.randn(num_tokens, 40)
    out = linear(x, weight, bias)
    assert out.shape == (num_tokens, 96)
    assert out.is_contiguous()  # row-major, as later ops (and SDPA's fast path) expect
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


def test_linear_takes_strided_rows_and_falls_back_on_odd_widths() -> None:
    torch.manual_seed(0)
    wide = torch.randn(5, 80)
    x = wide[:, ::2]  # [5, 40], non-contiguous
    weight = torch.randn(96, 40)
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight), atol=1e-5, rtol=1e-5)
    odd = torch.randn(95, 40)  # rows do not split evenly: plain F.linear
    torch.testing.assert_close(linear(x, odd), F.linear(x, odd))


def test_linear_module_is_a_drop_in_nn_linear() -> None:
    torch.manual_seed(0)
    module = Linear(40, 96, bias=True)
    x = torch.randn(7, 40)
    torch.testing.assert_close(module(x), F.linear(x, module.weight, module.bias), atol=1e-5, rtol=1e-5)
    assert set(module.state_dict()) == {"weight", "bias"}


# ----------------------------------------------------------------------------- native kernels
@pytest.mark.parametrize("onednn", [True, False])
def test_linear_uses_the_native_kernel_for_decode_batches_only(monkeypatch: pytest.MonkeyPatch,
                                                               onednn: bool) -> None:
    """1-128 rows (every decode step, single-stream included) go native, more to oneDNN; without
    oneDNN the kernel takes up to 512 rows, F.linear the rest."""
    kernel = require_kernel("linear", "native", native.linear_kernel)
    calls: list[int] = []

    class Spy:
        fits = staticmethod(kernel.fits)

        def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            calls.append(x.shape[0])
            return kernel(x, weight, bias)

    monkeypatch.setattr(layers, "linear_kernel", lambda: Spy())
    monkeypatch.setattr(layers, "_ONEDNN", onednn and layers._ONEDNN)
    if onednn and not layers._ONEDNN:
        pytest.skip("this torch build has no oneDNN (mkldnn)")
    torch.manual_seed(0)
    weight = torch.randn(64, 32)
    for rows in (1, 2, 3, 64, 128, 129, 512, 513):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight), atol=1e-5, rtol=1e-5)
    native_rows = [1, 2, 3, 64, 128] if onednn else [1, 2, 3, 64, 128, 129, 512]
    assert calls == native_rows
    linear(torch.randn(8, 40), torch.randn(64, 40))  # in_features 40 does not fit: torch
    linear(torch.randn(1, 40), torch.randn(64, 40))  # nor at one row: the row-split bmm
    assert calls == native_rows


@pytest.mark.parametrize("with_bias", [False, True])
def test_prefill_rows_go_to_onednn_on_the_stored_weight(monkeypatch: pytest.MonkeyPatch,
                                                         with_bias: bool) -> None:
    """Past 128 rows: oneDNN where torch has it (strided rows too), F.linear past 512 where it does not."""
    if not layers._ONEDNN:
        pytest.skip("this torch build has no oneDNN (mkldnn)")
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 576), (torch.randn(96) if with_bias else None)
    x = torch.randn(700, 600)[:, 12:588]  # 700 rows of 576, row stride 600
    calls: list[int] = []
    onednn = torch.ops.mkldnn._linear_pointwise

    def spy(*args: object) -> torch.Tensor:
        calls.append(args[0].shape[0])  # type: ignore[attr-defined]
        return onednn(*args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    out = linear(x, weight, bias)
    assert calls == [700] and out.shape == (700, 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
    short = torch.randn(129, 576)  # the first row count past the native kernel's
    torch.testing.assert_close(linear(short, weight, bias), F.linear(short, weight, bias),
                               atol=1e-4, rtol=1e-4)
    assert calls == [700, 129]
    linear(torch.randn(600, 576), torch.randn(576, 96).t())  # a transposed weight: F.linear
    monkeypatch.setattr(layers, "_ONEDNN", False)
    torch.testing.assert_close(linear(x, weight, bias), F.linear(x, weight, bias))
    assert calls == [700, 129]


def test_native_linear_off_or_without_compiler_falls_back_to_torch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVRELAY_NATIVE_KERNELS", "0")
    assert native.linear_kernel() is None
    monkeypatch.setenv("KVRELAY_NATIVE_KERNELS", "1")
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))  # nothing built here yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    native._load_linear.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert native.linear_kernel() is None
        assert "linear layers use torch only" in caplog.text
        x, weight = torch.randn(16, 32), torch.randn(64, 32)  # and linear still works
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight), atol=1e-5, rtol=1e-5)
    finally:
        native._load_linear.cache_clear()

import pytest
import torch
import torch.nn.functional as F

from kvrelay.model.layers import Linear, linear


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

"""The model's routes in the batch-invariant mode (kvrelay/model/invariant.py): a row's result is
the same bits however many rows share the call, for every build target of the native kernels."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvrelay.model.invariant import RotaryTable, invariant_linear, invariant_rms_norm, make_batch_invariant
from kvrelay.model.layers import Linear, RMSNorm, RotaryEmbedding, linear
from kvrelay.model.llama import CausalLM
from kvrelay.model.spec import ModelSpec
from tests.kernels.builds import skip_unless_runnable
from tests.tiny import hf_config

ROW_COUNTS = (1, 2, 3, 7, 64, 128, 129, 300, 600)  # across every route change of `linear`


@pytest.fixture
def built_for(arch: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The native kernels of `arch` are the ones the routes load (KVRELAY_NATIVE_ARCH)."""
    skip_unless_runnable(arch)
    monkeypatch.setenv("KVRELAY_NATIVE_ARCH", arch)
    return arch


@pytest.mark.parametrize(("out_features", "in_features", "bias"), [
    (960, 576, False),  # SmolLM2's fused qkv: the native kernel
    (64, 128, True),  # a Qwen2-style bias
    (6, 20, True),  # K % 16 and N % 4: one row at a time
])
def test_invariant_linear_gives_each_row_the_same_bits_at_every_row_count(
        built_for: str, out_features: int, in_features: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(max(ROW_COUNTS), in_features, generator=gen)
    full = invariant_linear(x, weight, b)
    for rows in ROW_COUNTS:
        assert torch.equal(invariant_linear(x[-rows:], weight, b), full[-rows:]), rows
    torch.testing.assert_close(full, F.linear(x, weight, b), rtol=1e-4, atol=1e-4)


def test_the_default_linear_changes_a_rows_bits_past_128_rows() -> None:
    """What the mode is for: outside it the route (and so the bits) follows the row count."""
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(960, 576, generator=gen), torch.randn(600, 576, generator=gen)
    assert not torch.equal(linear(x, weight)[:1], linear(x[:1], weight))


def test_invariant_rms_norm_gives_each_row_the_same_bits_at_every_row_count(built_for: str) -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(576, generator=gen)
    x = torch.randn(600, 576, generator=gen)
    full = invariant_rms_norm(x, weight, 1e-5)
    for rows in ROW_COUNTS:
        assert torch.equal(invariant_rms_norm(x[:rows], weight, 1e-5), full[:rows]), rows
    torch.testing.assert_close(full, F.rms_norm(x, (576,), weight, 1e-5))
    heads = x.view(600, 9, 64)[:, :4]  # q of a [T, heads, D] view, rows strided (Qwen3's q_norm)
    per_head = invariant_rms_norm(heads, weight[:64], 1e-5)
    assert per_head.shape == (600, 4, 64)
    assert torch.equal(per_head[5, 2], invariant_rms_norm(heads[5:6, 2:3], weight[:64], 1e-5)[0, 0])


def test_the_rotary_table_holds_each_positions_values_computed_once_in_double() -> None:
    rotary = RotaryEmbedding(64, 10000.0, None)
    table = RotaryTable(rotary.inv_freq, 300)
    assert len(table) == 300
    positions = torch.tensor([0, 299, 17, 17, 5])
    cos, sin = table.cos_sin(positions, torch.float32)
    assert cos.shape == sin.shape == (5, 1, 64)
    angle = float(torch.tensor(17.0) * rotary.inv_freq[3])  # the float32 angle cos_sin uses
    assert cos[2, 0, 3].item() == cos[2, 0, 35].item() == float(torch.tensor(math.cos(angle)))
    assert sin[2, 0, 3].item() == -float(torch.tensor(math.sin(angle)))
    alone_cos, _ = table.cos_sin(torch.tensor([17]), torch.float32)
    assert torch.equal(alone_cos[0], cos[2])
    want_cos, want_sin = rotary.cos_sin(positions, torch.float32)
    torch.testing.assert_close(cos, want_cos)
    torch.testing.assert_close(sin, want_sin)


def test_make_batch_invariant_sets_every_route_and_the_logits_take_it() -> None:
    spec = ModelSpec.from_hf_config(hf_config("llama").to_dict())
    model = CausalLM(spec)
    make_batch_invariant(model, 128)
    assert all(m.matmul is invariant_linear for m in model.modules() if isinstance(m, Linear))
    assert all(m.norm is invariant_rms_norm for m in model.modules() if isinstance(m, RMSNorm))
    assert len(model.model.rotary.table) == 128
    hidden = torch.randn(200, spec.hidden_size)
    assert torch.equal(model.compute_logits(hidden[:1]), model.compute_logits(hidden)[:1])

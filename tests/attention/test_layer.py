"""Paged attention against a plain reference, the per-step metadata, and the connector hooks."""

from __future__ import annotations

import math

import pytest
import torch

from kvrelay.attention.backends import CpuBackend
from kvrelay.attention.forward_context import ForwardContext, set_forward_context
from kvrelay.attention.layer import Attention, build_attention_metadata
from kvrelay.kernels import native
from kvrelay.kernels.native import paged_decode_kernel
from kvrelay.utils import cdiv
from tests.kernels.builds import ARCHS, require_kernel

H, HKV, D, BS = 4, 2, 8, 4


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_offset: int) -> torch.Tensor:
    """q [Tq, H, D], k/v [S, Hkv, D] (the whole context) -> [Tq, H*D], causal from query_offset."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [S, H, D]
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])  # [H, Tq, S]
    allowed = torch.arange(k.shape[0])[None, :] <= query_offset + torch.arange(q.shape[0])[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v).reshape(q.shape[0], -1)


def test_metadata_slots_and_groups() -> None:
    # seq 0 decodes its 6th token; seq 1 prefills 3 tokens after 5 cached; seq 2 is fresh (2 tokens)
    meta = build_attention_metadata(
        [1, 3, 2], [6, 8, 2], [[9, 4, 7], [2, 5], [3, 0]], BS, torch.device("cpu")
    )
    assert meta.query_start_loc == [0, 1, 4, 6]
    assert meta.slot_mapping.tolist() == [4 * BS + 1, 5 * BS + 1, 5 * BS + 2, 5 * BS + 3, 3 * BS, 3 * BS + 1]
    assert meta.decode is not None and meta.decode.token_index == slice(0, 1)
    assert meta.decode.block_ids.tolist() == [9, 4]
    assert [(p.start, p.end, p.block_ids is None) for p in meta.prefills] == [(1, 4, False), (4, 6, True)]


def test_metadata_rejects_short_block_table() -> None:
    with pytest.raises(ValueError, match="needs 3"):
        build_attention_metadata([1], [9], [[1, 2]], BS, torch.device("cpu"))


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [1, 0, 3, 2], [2, 3, 0, 1]])
def test_paged_attention_matches_reference_in_any_batch_order(order: list[int]) -> None:
    torch.manual_seed(0)
    # (cached tokens, new tokens): two decodes, a prefill after a cached prefix, a fresh prefill
    all_seqs = [(9, 1), (2, 1), (6, 5), (0, 7)]
    all_tables = [[17, 3, 11, 8], [5, 14], [1, 12, 6, 19], [0, 9]]  # the third lists a spare block
    seqs, tables = [all_seqs[i] for i in order], [all_tables[i] for i in order]
    cache = torch.zeros(20, 2, HKV, BS, D)
    context_k = [torch.randn(c + n, HKV, D) for c, n in seqs]
    context_v = [torch.randn(c + n, HKV, D) for c, n in seqs]
    for (cached, _), table, k, v in zip(seqs, tables, context_k, context_v, strict=True):
        for pos in range(cached):  # what earlier steps (or a connector) left in the cache
            cache[table[pos // BS], 0, :, pos % BS] = k[pos]
            cache[table[pos // BS], 1, :, pos % BS] = v[pos]
    q = [torch.randn(n, H, D) for _, n in seqs]
    meta = build_attention_metadata(
        [n for _, n in seqs], [c + n for c, n in seqs], tables, BS, torch.device("cpu")
    )
    attn = Attention("layer", H, HKV, D, scale=D**-0.5)
    attn.kv_cache = cache
    new_k = torch.cat([k[c:] for (c, _), k in zip(seqs, context_k, strict=True)]).flatten(1)
    new_v = torch.cat([v[c:] for (c, _), v in zip(seqs, context_v, strict=True)]).flatten(1)
    with set_forward_context(ForwardContext(attn_metadata={"layer": meta})):
        out = attn(torch.cat(q).flatten(1), new_k, new_v)
    expected = torch.cat(
        [
            reference_attention(qi, k, v, c)
            for (c, _), qi, k, v in zip(seqs, q, context_k, context_v, strict=True)
        ]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for (c, n), table, k in zip(
        seqs, tables, context_k, strict=True
    ):  # this step's keys landed in their slots
        for pos in range(c, c + n):
            torch.testing.assert_close(cache[table[pos // BS], 0, :, pos % BS], k[pos])


class RecordingConnector:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(("wait_for_layer_load", layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: object) -> None:
        assert kv_layer.shape[1] == 2 and attn_metadata is not None
        self.calls.append(("save_kv_layer", layer_name))


def test_connector_hooks_wrap_every_layer_in_order() -> None:
    pytest.importorskip("transformers")
    from tests.model.tiny import PagedDriver, build_from_hf, hf_tiny_model

    model = build_from_hf(hf_tiny_model("llama"))
    driver = PagedDriver(model)
    driver.add("a", list(range(10)))
    connector = RecordingConnector()
    driver.step([("a", 6)], connector=connector)
    driver.step([("a", 4)], connector=connector)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(model.spec.num_layers)]
    assert list(model.attention_layers()) == names
    one_step = [(hook, name) for name in names for hook in ("wait_for_layer_load", "save_kv_layer")]
    assert connector.calls == one_step * 2


def scattered_decode(
    num_heads: int, num_kv_heads: int, head_dim: int, lens: list[int], sharpness: float = 1.0,
    block_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step over a paged cache whose blocks are shuffled: returns the layer output and the
    reference computed from the cache contents (including this step's k/v, written by the layer)."""
    torch.manual_seed(1)
    counts = [cdiv(n, block_size) for n in lens]
    perm = torch.randperm(sum(counts) + 3).tolist()  # blocks anywhere, a few unused
    tables = [perm[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(len(lens))]
    attn = Attention("layer", num_heads, num_kv_heads, head_dim, scale=head_dim**-0.5)
    attn.kv_cache = torch.randn(len(perm), 2, num_kv_heads, block_size, head_dim)
    q = torch.randn(len(lens), num_heads * head_dim) * sharpness
    new_k, new_v = torch.randn(2, len(lens), num_kv_heads * head_dim)
    meta = build_attention_metadata([1] * len(lens), lens, tables, block_size, torch.device("cpu"))
    with set_forward_context(ForwardContext(attn_metadata={"layer": meta})):
        out = attn(q, new_k, new_v)
    expected = []
    for i, (seq_len, table) in enumerate(zip(lens, tables, strict=True)):
        blocks = attn.kv_cache[table]  # [nb, 2, Hkv, bs, D]
        k = blocks[:, 0].transpose(1, 2).reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [S, Hkv, D]
        v = blocks[:, 1].transpose(1, 2).reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [S, Hkv, D]
        torch.testing.assert_close(k[-1].flatten(), new_k[i])  # this step's key landed in its slot
        expected.append(reference_attention(q[i].view(1, num_heads, head_dim), k, v, seq_len - 1))
    return out, torch.cat(expected)


def use_native_decode(arch: str, monkeypatch: pytest.MonkeyPatch) -> native.PagedDecode:
    """Attention layers will decode with the kernel built for `arch` (a build failure fails the test)."""
    monkeypatch.setenv("KVRELAY_NATIVE_ARCH", arch)
    return require_kernel("paged_decode", arch, native.paged_decode_kernel)


@pytest.mark.parametrize("route", ["torch", *ARCHS])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (8, 2, 24), (2, 1, 64)]
)
def test_decode_over_scattered_blocks_matches_reference(
    route: str, num_heads: int, num_kv_heads: int, head_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """head_dim 24: a multiple of the 8-float vectors of AVX2 but not of AVX-512's 16 (scalar loop)."""
    monkeypatch.setenv("KVRELAY_NATIVE_KERNELS", "0" if route == "torch" else "1")
    if route != "torch":
        use_native_decode(route, monkeypatch)
    lens = [1, 15, 16, 17, 40, 300]  # one token, inside a block, at and across block edges, long
    out, expected = scattered_decode(num_heads, num_kv_heads, head_dim, lens)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_native_decode_handles_peaked_softmax(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Scores far apart: most weights underflow to zero, as in a model attending to one token.
    use_native_decode(arch, monkeypatch)
    out, expected = scattered_decode(9, 3, 64, [5, 70, 129], sharpness=40.0)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_seqs", [3, 40])
def test_native_decode_any_block_size_and_batch(block_size: int, num_seqs: int, arch: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel splits a small batch by KV head and takes whole sequences in a large one; a block
    # is scored a vector's worth of rows (16, 8 or 4) at a time, with a remainder.
    use_native_decode(arch, monkeypatch)
    lens = [1 + (37 * i) % 150 for i in range(num_seqs)]
    out, expected = scattered_decode(9, 3, 64, lens, block_size=block_size)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_native_decode_rescales_when_a_later_block_holds_the_maximum(arch: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # The softmax runs online, block by block: a larger score in a later block must shrink the
    # weights accumulated so far. Keys grow along the context, so each block beats the last.
    kernel = use_native_decode(arch, monkeypatch)
    block_size, head_dim, seq_len = 16, 64, 100
    blocks = cdiv(seq_len, block_size)
    cache = torch.zeros(blocks, 2, 1, block_size, head_dim)
    keys = torch.linspace(0.0, 3.0, blocks * block_size)[:, None] * torch.ones(head_dim) / 8  # [L, D]
    values = torch.randn(blocks * block_size, head_dim)
    cache[:, 0, 0] = keys.view(blocks, block_size, head_dim)
    cache[:, 1, 0] = values.view(blocks, block_size, head_dim)
    q = torch.ones(1, head_dim)
    out = torch.empty(1, head_dim)
    kernel(q, cache, torch.arange(blocks)[None], torch.tensor([seq_len]), out, 1.0)
    weights = torch.softmax(keys[:seq_len] @ q[0], dim=0)
    torch.testing.assert_close(out[0], weights @ values[:seq_len], atol=2e-5, rtol=2e-5)


def test_native_kernel_off_or_without_compiler_falls_back_to_torch(
    monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVRELAY_NATIVE_KERNELS", "0")
    assert paged_decode_kernel() is None
    monkeypatch.setenv("KVRELAY_NATIVE_KERNELS", "1")
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))  # nothing built here yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    native._load_paged_decode.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert paged_decode_kernel() is None
        assert "no C compiler" in caplog.text and "decode attention uses torch" in caplog.text
        out, expected = scattered_decode(4, 2, 64, [3, 33])  # and attention still works
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    finally:
        native._load_paged_decode.cache_clear()


def test_native_kernel_rejects_a_layout_it_would_misread() -> None:
    kernel = require_kernel("paged_decode", "native", native.paged_decode_kernel)
    cache = torch.zeros(8, 2, 2, 16, 64)
    q, out = torch.zeros(3, 4 * 64), torch.zeros(3, 4 * 64)
    tables, lens = torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, dtype=torch.int64)
    kernel(q, cache, tables, lens, out, 0.125)  # well formed: runs
    with pytest.raises(ValueError, match="block_tables must be a CPU torch.int64"):
        kernel(q, cache, tables.int(), lens, out, 0.125)
    with pytest.raises(ValueError, match="kv_cache must be a contiguous"):
        kernel(q, cache.transpose(2, 3), tables, lens, out, 0.125)
    with pytest.raises(ValueError, match="shapes disagree"):
        kernel(q, cache, tables, lens[:2], out, 0.125)
    with pytest.raises(ValueError, match="q rows must be contiguous"):
        kernel(torch.zeros(4 * 64, 3).t(), cache, tables, lens, out, 0.125)


def test_decode_refuses_a_block_id_outside_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    use_native_decode("native", monkeypatch)
    attn = Attention("layer", 4, 2, 64, scale=0.125)
    attn.kv_cache = torch.zeros(4, 2, 2, 16, 64)
    meta = build_attention_metadata([1], [20], [[1, 9]], 16, torch.device("cpu"))  # block 9 of 4
    with set_forward_context(ForwardContext(attn_metadata={"layer": meta})):
        with pytest.raises(ValueError, match="block id 9 is outside the KV cache"):
            CpuBackend().decode(attn, torch.zeros(1, 4 * 64), meta.decode, meta)


def test_kv_write_refuses_a_slot_outside_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRELAY_NATIVE_ARCH", "native")
    require_kernel("elementwise", "native", native.elementwise_kernels)
    attn = Attention("layer", 4, 2, 64, scale=0.125)
    attn.kv_cache = torch.zeros(4, 2, 2, 16, 64)
    meta = build_attention_metadata([2], [20], [[1, 9]], 16, torch.device("cpu"))  # slots in block 9 of 4
    with pytest.raises(ValueError, match="slots 146..147 fall outside the KV cache"):
        CpuBackend().write_kv(attn, torch.zeros(2, 128), torch.zeros(2, 128), meta)
    assert not attn.kv_cache.any()  # nothing written

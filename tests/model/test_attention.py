"""Paged attention against a plain reference, the per-step metadata, and the connector hooks."""

from __future__ import annotations

import math

import pytest
import torch

from kvrelay.model.attention import Attention, build_attention_metadata
from kvrelay.worker.forward_context import ForwardContext, set_forward_context

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

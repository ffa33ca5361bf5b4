"""A step's host-side description (`StepBatch`) and the CPU and torch routes' metadata, against a
per-token reference, on both of StepBatch's paths (a few decoding sequences in Python, anything
else in numpy)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvrelay.attention.metadata import _LIST_MAX_SEQS, StepBatch, reference_metadata
from kvrelay.utils import cdiv

BS = 4
CPU = torch.device("cpu")


Step = tuple[list[int], list[int], list[list[int]]]  # query lengths, sequence lengths, block tables


def random_step(rng: random.Random, num_seqs: int, decode_only: bool) -> Step:
    """Lengths and block tables of a step: every table covers its sequence, some hold more blocks."""
    query_lens, seq_lens, tables = [], [], []
    for _ in range(num_seqs):
        query_len = 1 if decode_only or rng.random() < 0.5 else rng.randint(0, 9)
        seq_len = query_len + rng.randint(0 if query_len else 1, 30)
        query_lens.append(query_len)
        seq_lens.append(seq_len)
        tables.append(rng.sample(range(500), cdiv(seq_len, BS) + rng.randint(0, 2)))
    return query_lens, seq_lens, tables


def per_token(query_lens: list[int], seq_lens: list[int], tables: list[list[int]]) -> tuple[list[int], ...]:
    positions, slots = [], []
    for query_len, seq_len, table in zip(query_lens, seq_lens, tables, strict=True):
        for position in range(seq_len - query_len, seq_len):
            positions.append(position)
            slots.append(table[position // BS] * BS + position % BS)
    return positions, slots


@pytest.mark.parametrize("decode_only", [True, False])
@pytest.mark.parametrize("num_seqs", [1, 2, _LIST_MAX_SEQS, _LIST_MAX_SEQS + 1, 40])
def test_positions_slots_and_offsets_match_a_per_token_reference(num_seqs: int, decode_only: bool) -> None:
    rng = random.Random(num_seqs * 2 + decode_only)
    for _ in range(20):
        query_lens, seq_lens, tables = random_step(rng, num_seqs, decode_only)
        batch = StepBatch.from_lists(query_lens, seq_lens, tables, BS, CPU)
        positions, slots = per_token(query_lens, seq_lens, tables)
        assert batch.positions.tolist() == positions and batch.positions.dtype == np.int64
        assert batch.slot_mapping.tolist() == slots and batch.slot_mapping.dtype == np.int64
        assert batch.query_start_loc.tolist() == np.concatenate([[0], np.cumsum(query_lens)]).tolist()
        assert batch.query_start_loc.dtype == np.int32
        assert batch.is_decode_only == (query_lens.count(1) == num_seqs)
        assert batch.num_tokens == sum(query_lens)


@pytest.mark.parametrize("num_seqs", [1, _LIST_MAX_SEQS + 3])
@pytest.mark.parametrize(("query_len", "seq_len", "table_len", "message"), [
    (1, 9, 2, "seq 0: block table has 2 blocks but seq_len 9 needs 3"),
    (1, 0, 1, "seq 0: need 0 <= query_len <= seq_len, got 1 and 0"),
    (5, 3, 1, "seq 0: need 0 <= query_len <= seq_len, got 5 and 3"),
])
def test_an_invalid_sequence_is_named_on_either_path(num_seqs: int, query_len: int, seq_len: int,
                                                     table_len: int, message: str) -> None:
    query_lens = [query_len] + [1] * (num_seqs - 1)
    seq_lens = [seq_len] + [5] * (num_seqs - 1)
    tables = [list(range(table_len))] + [[7, 8]] * (num_seqs - 1)
    with pytest.raises(ValueError, match=message):
        StepBatch.from_lists(query_lens, seq_lens, tables, BS, CPU)


@pytest.mark.parametrize("num_seqs", [3, _LIST_MAX_SEQS + 3])
def test_decode_metadata_pads_shorter_tables_with_their_first_block(num_seqs: int) -> None:
    seq_lens = [9] + [3] * (num_seqs - 1)  # 3 blocks, then 1 block each
    tables = [[11, 12, 13]] + [[20 + i, 90, 91] for i in range(1, num_seqs)]  # extra ids past the used
    meta = reference_metadata(StepBatch.from_lists([1] * num_seqs, seq_lens, tables, BS, CPU))
    decode = meta.decode
    assert decode is not None and meta.prefills == []
    assert decode.token_index == slice(0, num_seqs) and decode.max_blocks == 3
    rows = decode.block_ids.view(num_seqs, 3).tolist()
    assert rows == [[11, 12, 13]] + [[20 + i] * 3 for i in range(1, num_seqs)]
    assert decode.max_block_id == max(13, 20 + num_seqs - 1)
    assert decode.seq_lens.tolist() == seq_lens and decode.seq_lens.dtype == torch.int64
    slots = [13 * BS] + [(20 + i) * BS + 2 for i in range(1, num_seqs)]
    assert meta.slot_mapping.tolist() == slots
    assert meta.slot_range == (min(slots), max(slots))
    assert meta.slot_block_ids.tolist() == [s // BS for s in slots]
    assert meta.slot_offsets.tolist() == [s % BS for s in slots]


def test_mixed_metadata_takes_decode_rows_out_of_order() -> None:
    # a prefill between two decodes: the decode rows are 0 and 4, read through an index tensor
    meta = reference_metadata(StepBatch.from_lists([1, 3, 1], [6, 3, 2], [[9, 4], [2], [5]], BS, CPU))
    assert meta.decode is not None and meta.decode.token_index.tolist() == [0, 4]
    assert [(p.start, p.end) for p in meta.prefills] == [(1, 4)]
    assert meta.query_start_loc == [0, 1, 4, 5]


def test_metadata_reuses_the_slots_the_runner_uploaded() -> None:
    batch = StepBatch.from_lists([1], [6], [[9, 4]], BS, CPU)
    uploaded = batch.device_inputs()
    assert reference_metadata(batch).slot_mapping is uploaded.slot_mapping

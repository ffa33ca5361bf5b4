"""What one step's attention needs to know, shared by every layer: which cache slot each new token
writes, which blocks each sequence reads.

The runner describes the step once, on the host, as a `StepBatch` (numpy arrays: query and
context lengths, block tables, slots). Each attention backend turns it into its own metadata:
the CPU and torch routes into the `AttentionMetadata` below, which splits the flat batch in two
kinds of work:
- decodes (one query token): attended to as ONE batch per layer, reading every sequence's blocks
  through a padded block table and masking the padding;
- prefills (several query tokens: a prompt, a chunk of one, or a suffix after a prefix hit): one
  `scaled_dot_product_attention` call each, causal with the query offset `seq_len - query_len`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvrelay.utils import cdiv


@dataclass
class DeviceInputs:
    """A step's index tensors on the model's device (the runner uploads them once per step, with
    the input ids; see kvrelay/worker/staging.py)."""

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [S, W] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32


@dataclass
class StepBatch:
    """One step's sequences, in the flat batch's order, on the host.

    Sequence i's query tokens are the flat rows [query_start_loc[i], query_start_loc[i + 1]), at
    positions seq_lens[i] - query_lens[i] .. seq_lens[i] - 1; its KV lives in the blocks
    block_tables[i, :num_blocks[i]] (the rest of the row is padding)."""

    query_lens: np.ndarray  # [S] int32
    seq_lens: np.ndarray  # [S] int32, context length after this step
    block_tables: np.ndarray  # [S, W] int32
    num_blocks: np.ndarray  # [S] int32, the valid leading entries of each block-table row
    block_size: int
    device: torch.device
    query_start_loc: np.ndarray = field(init=False)  # [S + 1] int32
    positions: np.ndarray = field(init=False)  # [T] int64, each query token's position
    slot_mapping: np.ndarray = field(init=False)  # [T] int64: block_id * block_size + offset
    # What the runner uploaded for this step (None: a backend uploads what it needs itself).
    uploaded: DeviceInputs | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        needed = (self.seq_lens + self.block_size - 1) // self.block_size  # [S]
        valid = (self.query_lens >= 0) & (self.seq_lens >= self.query_lens) & (self.num_blocks >= needed)
        if not valid.all():
            for i, (query_len, seq_len, valid) in enumerate(zip(
                    self.query_lens.tolist(), self.seq_lens.tolist(), self.num_blocks.tolist(), strict=True)):
                _check_seq(i, query_len, seq_len, valid, self.block_size)
        self.query_start_loc = np.zeros(len(self.query_lens) + 1, dtype=np.int32)
        np.cumsum(self.query_lens, out=self.query_start_loc[1:])
        seq = np.repeat(np.arange(len(self.query_lens)), self.query_lens)  # [T], each token's sequence
        first = (self.seq_lens - self.query_lens)[seq]  # [T], its sequence's first query position
        positions = first + np.arange(len(seq)) - self.query_start_loc[:-1][seq]  # [T]
        blocks = self.block_tables[seq, positions // self.block_size].astype(np.int64)  # [T]
        self.slot_mapping = blocks * self.block_size + positions % self.block_size  # [T]
        self.positions = positions.astype(np.int64)

    @classmethod
    def from_lists(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                   block_size: int, device: torch.device) -> StepBatch:
        if not len(query_lens) == len(seq_lens) == len(block_tables):
            raise ValueError(
                f"query_lens, seq_lens and block_tables must have one entry per sequence, got "
                f"{len(query_lens)}, {len(seq_lens)}, {len(block_tables)}"
            )
        width = max((len(t) for t in block_tables), default=0)
        tables = np.zeros((len(block_tables), max(width, 1)), dtype=np.int32)
        for i, table in enumerate(block_tables):
            tables[i, :len(table)] = table
        as_array = lambda values: np.asarray(values, dtype=np.int32).reshape(-1)  # noqa: E731
        return cls(as_array(query_lens), as_array(seq_lens), tables, as_array([len(t) for t in block_tables]),
                   block_size, device)

    def device_inputs(self) -> DeviceInputs:
        """The step's index tensors on its device (uploaded here when the runner did not)."""
        if self.uploaded is None:
            def upload(array: np.ndarray) -> torch.Tensor:
                return torch.from_numpy(array).to(self.device)

            self.uploaded = DeviceInputs(
                positions=upload(self.positions), slot_mapping=upload(self.slot_mapping),
                block_tables=upload(self.block_tables), seq_lens=upload(self.seq_lens),
                query_start_loc=upload(self.query_start_loc))
        return self.uploaded

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def max_query_len(self) -> int:
        return int(self.query_lens.max(initial=0))

    @property
    def is_decode_only(self) -> bool:
        """Every sequence has exactly one query token (a CUDA graph can replay this step)."""
        return self.num_seqs > 0 and bool((self.query_lens == 1).all())


def _check_seq(i: int, query_len: int, seq_len: int, num_blocks: int, block_size: int) -> None:
    if query_len < 0 or seq_len < query_len:
        raise ValueError(f"seq {i}: need 0 <= query_len <= seq_len, got {query_len} and {seq_len}")
    needed = cdiv(seq_len, block_size)
    if num_blocks < needed:
        raise ValueError(
            f"seq {i}: block table has {num_blocks} blocks but seq_len {seq_len} needs {needed} "
            f"(block_size {block_size})"
        )


# ----------------------------------------------------------------------------- the CPU and torch routes


@dataclass
class DecodeBatch:
    """The sequences with exactly one query token this step, attended to together."""

    token_index: slice | torch.Tensor  # their rows in the flat batch (a slice when consecutive)
    num_seqs: int
    max_blocks: int  # padded block-table width
    block_ids: torch.Tensor  # [num_seqs * max_blocks] int64, padded block tables, row-major
    seq_lens: torch.Tensor  # [num_seqs] int64, context length of each after this step
    max_block_id: int  # the largest id in block_ids (checked against the cache before native reads)
    padded_len: int  # max_blocks * block_size, the context length every sequence is padded to
    _mask_by_dtype: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    def mask_as(self, dtype: torch.dtype) -> torch.Tensor:
        """[num_seqs, 1, padded_len]: 0 on a sequence's context, -inf on its padding. Built on first
        use, once per step: only the torch route needs it, the native kernel reads seq_lens."""
        if dtype not in self._mask_by_dtype:
            key_pos = torch.arange(self.padded_len, device=self.seq_lens.device)  # [L]
            in_context = key_pos[None, :] < self.seq_lens[:, None]  # [num_seqs, L]
            mask = torch.zeros(in_context.shape, dtype=dtype, device=self.seq_lens.device)
            self._mask_by_dtype[dtype] = mask.masked_fill_(~in_context, float("-inf"))[:, None, :]
        return self._mask_by_dtype[dtype]


@dataclass
class PrefillSeq:
    """A sequence with several query tokens this step."""

    start: int  # its rows [start, end) in the flat batch
    end: int
    seq_len: int  # context length after this step
    # When part of the context was cached before this step, attention reads the whole context
    # back from these blocks and needs an explicit mask; a fresh prompt needs neither.
    block_ids: torch.Tensor | None  # [ceil(seq_len / block_size)] int64
    mask: torch.Tensor | None  # [query_len, seq_len] bool, True = may attend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset, per token
    query_start_loc: list[int]  # len num_seqs + 1; seq i owns flat tokens [qsl[i], qsl[i+1])
    seq_lens: list[int]  # context length of seq i after this step
    block_size: int
    slot_block_ids: torch.Tensor  # [num_tokens] int64: slot_mapping // block_size
    slot_offsets: torch.Tensor  # [num_tokens] int64: slot_mapping % block_size
    decode: DecodeBatch | None
    prefills: list[PrefillSeq]
    slot_range: tuple[int, int]  # (min, max) of slot_mapping, (0, -1) if empty; checked before C writes
    # Scratch buffers shared by all layers of this step (filled lazily by the first layer).
    workspace: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = field(
        default_factory=dict, repr=False
    )

    def scratch(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A scratch tensor reused by every layer of this step (layers run one after another)."""
        key = (shape, dtype)
        buf = self.workspace.get(key)
        if buf is None:
            buf = torch.empty(shape, dtype=dtype, device=self.slot_mapping.device)
            self.workspace[key] = buf
        return buf


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Seq i's query tokens sit at positions seq_lens[i]-query_lens[i] .. seq_lens[i]-1.
    block_tables[i] lists the KV block ids of seq i in order, covering at least
    ceil(seq_lens[i]/block_size) blocks (it may list more)."""
    return reference_metadata(StepBatch.from_lists(query_lens, seq_lens, block_tables, block_size, device))


def reference_metadata(batch: StepBatch) -> AttentionMetadata:
    """The CPU and torch routes' metadata of a step (built once per step, shared by all layers)."""
    slot_mapping = torch.from_numpy(batch.slot_mapping).to(batch.device)  # [T] int64
    is_decode = batch.query_lens == 1  # [S]
    decode = _decode_batch(batch, np.flatnonzero(is_decode)) if is_decode.any() else None
    qsl = batch.query_start_loc.tolist()
    prefills = [_prefill_seq(batch, int(i), qsl[i]) for i in np.flatnonzero(batch.query_lens > 1)]
    slots = batch.slot_mapping
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=qsl,
        seq_lens=batch.seq_lens.tolist(),
        block_size=batch.block_size,
        slot_block_ids=slot_mapping // batch.block_size,
        slot_offsets=slot_mapping % batch.block_size,
        decode=decode,
        prefills=prefills,
        slot_range=(int(slots.min()), int(slots.max())) if len(slots) else (0, -1),
    )


def _prefill_seq(batch: StepBatch, i: int, start: int) -> PrefillSeq:
    query_len, seq_len, block_size = int(batch.query_lens[i]), int(batch.seq_lens[i]), batch.block_size
    device = batch.device
    if query_len == seq_len:  # nothing cached before: causal attention over this step's k/v
        return PrefillSeq(start, start + query_len, seq_len, None, None)
    num_blocks = cdiv(seq_len, block_size)
    block_ids = torch.from_numpy(batch.block_tables[i, :num_blocks].astype(np.int64)).to(device)
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)  # [query_len]
    key_pos = torch.arange(seq_len, device=device)  # [seq_len]
    mask = key_pos[None, :] <= query_pos[:, None]  # [query_len, seq_len]
    return PrefillSeq(start, start + query_len, seq_len, block_ids, mask)


def _decode_batch(batch: StepBatch, seqs: np.ndarray) -> DecodeBatch:
    lens = batch.seq_lens[seqs]  # [n]
    block_size, device = batch.block_size, batch.device
    max_blocks = cdiv(int(lens.max()), block_size)
    used = (lens + block_size - 1) // block_size  # [n], blocks each sequence reads
    rows = batch.block_tables[seqs][:, :max_blocks].astype(np.int64)  # [n, max_blocks]
    if rows.shape[1] < max_blocks:  # the tables hold fewer columns than the longest needs
        raise ValueError(f"block tables are {rows.shape[1]} wide, the longest sequence needs {max_blocks}")
    padding = np.arange(max_blocks)[None, :] >= used[:, None]  # [n, max_blocks]
    rows = np.where(padding, rows[:, :1], rows)  # pad with a real block (the row's first)
    rows_in_batch = batch.query_start_loc[seqs]  # [n]
    first = int(rows_in_batch[0])
    token_index: slice | torch.Tensor
    if (np.diff(rows_in_batch) == 1).all():
        token_index = slice(first, first + len(seqs))
    else:
        token_index = torch.from_numpy(rows_in_batch.astype(np.int64)).to(device)
    return DecodeBatch(token_index, len(seqs), max_blocks, torch.from_numpy(rows.reshape(-1)).to(device),
                       torch.from_numpy(lens.astype(np.int64)).to(device), int(rows.max()),
                       max_blocks * block_size)

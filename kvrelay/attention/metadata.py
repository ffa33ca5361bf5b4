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


_LIST_MAX_SEQS = 8  # up to this many sequences, a decode-only step's arrays are built in Python


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
    _decode_only: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        num_seqs = len(self.query_lens)
        if 0 < num_seqs <= _LIST_MAX_SEQS:
            query_lens = self.query_lens.tolist()
            self._decode_only = query_lens.count(1) == num_seqs
        else:
            self._decode_only = num_seqs > 0 and bool((self.query_lens == 1).all())
        if self._decode_only and num_seqs <= _LIST_MAX_SEQS:
            self._small_decode()
            return
        if self._decode_only:  # the common step, in fewer array operations: token i is sequence i's
            positions = self.seq_lens - 1  # [S], the one position each sequence computes
            block_index = positions // self.block_size  # [S]
            if positions.min() < 0 or (block_index >= self.num_blocks).any():
                self._check_each()
            self.query_start_loc = np.arange(num_seqs + 1, dtype=np.int32)
            blocks = self.block_tables[np.arange(num_seqs), block_index]  # [S]
        else:
            needed = (self.seq_lens + self.block_size - 1) // self.block_size  # [S]
            lengths_ok = (self.query_lens >= 0) & (self.seq_lens >= self.query_lens)  # [S]
            if not (lengths_ok & (self.num_blocks >= needed)).all():
                self._check_each()
            self.query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
            np.cumsum(self.query_lens, out=self.query_start_loc[1:])
            seq = np.repeat(np.arange(num_seqs), self.query_lens)  # [T], each token's sequence
            first = (self.seq_lens - self.query_lens)[seq]  # [T], its sequence's first query position
            positions = first + np.arange(len(seq)) - self.query_start_loc[:-1][seq]  # [T]
            blocks = self.block_tables[seq, positions // self.block_size]  # [T]
        self.positions = positions.astype(np.int64)  # [T]
        offsets = self.positions % self.block_size  # [T]
        self.slot_mapping = blocks.astype(np.int64) * self.block_size + offsets  # [T]

    def _small_decode(self) -> None:
        """A decode-only step of a few sequences, in plain Python: the same arrays as the vectorised
        path, without its ~1 us per numpy call (a dozen of them) that outweighs the work here."""
        block_size, tables = self.block_size, self.block_tables
        positions, slots = [], []
        for i, (seq_len, num_blocks) in enumerate(zip(self.seq_lens.tolist(), self.num_blocks.tolist(),
                                                       strict=True)):
            position = seq_len - 1
            if position < 0 or position // block_size >= num_blocks:
                self._check_each()
            positions.append(position)
            slots.append(int(tables[i, position // block_size]) * block_size + position % block_size)
        self.query_start_loc = np.arange(len(positions) + 1, dtype=np.int32)
        self.positions = np.array(positions, dtype=np.int64)  # [S]
        self.slot_mapping = np.array(slots, dtype=np.int64)  # [S]

    def _check_each(self) -> None:
        """Raise ValueError naming the first sequence whose lengths or block table are invalid."""
        for i, (query_len, seq_len, num_blocks) in enumerate(zip(
                self.query_lens.tolist(), self.seq_lens.tolist(), self.num_blocks.tolist(), strict=True)):
            _check_seq(i, query_len, seq_len, num_blocks, self.block_size)

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
        return self._decode_only


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
    decode: DecodeBatch | None
    prefills: list[PrefillSeq]
    slot_range: tuple[int, int]  # (min, max) of slot_mapping, (0, -1) if empty; checked before C writes
    # Scratch buffers shared by all layers of this step (filled lazily by the first layer).
    workspace: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = field(
        default_factory=dict, repr=False
    )
    _slots: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def slot_block_ids(self) -> torch.Tensor:
        """[num_tokens] int64: slot_mapping // block_size (the torch route's KV write; built once)."""
        return self._slot_split()[0]

    @property
    def slot_offsets(self) -> torch.Tensor:
        """[num_tokens] int64: slot_mapping % block_size."""
        return self._slot_split()[1]

    def _slot_split(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._slots is None:
            self._slots = (self.slot_mapping // self.block_size, self.slot_mapping % self.block_size)
        return self._slots

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
    if batch.uploaded is not None and batch.uploaded.slot_mapping.device == batch.device:
        slot_mapping = batch.uploaded.slot_mapping  # [T] int64, already there
    else:
        slot_mapping = torch.from_numpy(batch.slot_mapping).to(batch.device)
    qsl = batch.query_start_loc.tolist()
    if batch.is_decode_only:
        decode: DecodeBatch | None = _decode_batch(batch, None)
        prefills = []
    else:
        is_decode = batch.query_lens == 1  # [S]
        decode = _decode_batch(batch, np.flatnonzero(is_decode)) if is_decode.any() else None
        prefills = [_prefill_seq(batch, int(i), qsl[i]) for i in np.flatnonzero(batch.query_lens > 1)]
    slots = batch.slot_mapping
    if len(slots) <= _LIST_MAX_SEQS:  # Python's min and max beat numpy's reductions on a few
        slot_list = slots.tolist()
        slot_range = (min(slot_list), max(slot_list)) if slot_list else (0, -1)
    else:
        slot_range = (int(slots.min()), int(slots.max()))
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=qsl,
        seq_lens=batch.seq_lens.tolist(),
        block_size=batch.block_size,
        decode=decode,
        prefills=prefills,
        slot_range=slot_range,
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


def _decode_batch(batch: StepBatch, seqs: np.ndarray | None) -> DecodeBatch:
    """The one-query sequences `seqs` (None: every sequence of a decode-only step)."""
    lens = batch.seq_lens if seqs is None else batch.seq_lens[seqs]  # [n]
    tables = batch.block_tables if seqs is None else batch.block_tables[seqs]  # [n, W]
    block_size, device = batch.block_size, batch.device
    lens_list = lens.tolist()
    max_blocks = cdiv(max(lens_list), block_size)
    if tables.shape[1] < max_blocks:  # the tables hold fewer columns than the longest needs
        raise ValueError(f"block tables are {tables.shape[1]} wide, the longest sequence needs {max_blocks}")
    rows = tables[:, :max_blocks].astype(np.int64)  # [n, max_blocks]
    if min(lens_list) <= (max_blocks - 1) * block_size:  # a shorter row: pad it with a real block (its first)
        used = (lens + block_size - 1) // block_size  # [n], blocks each sequence reads
        padding = np.arange(max_blocks)[None, :] >= used[:, None]  # [n, max_blocks]
        rows = np.where(padding, rows[:, :1], rows)
    token_index: slice | torch.Tensor
    if seqs is None:
        token_index = slice(0, len(lens_list))
    else:
        rows_in_batch = batch.query_start_loc[seqs]  # [n]
        first = int(rows_in_batch[0])
        if (np.diff(rows_in_batch) == 1).all():
            token_index = slice(first, first + len(seqs))
        else:
            token_index = torch.from_numpy(rows_in_batch.astype(np.int64)).to(device)
    return DecodeBatch(token_index, len(lens_list), max_blocks, torch.from_numpy(rows.reshape(-1)).to(device),
                       torch.from_numpy(lens.astype(np.int64)).to(device), int(rows.max()),
                       max_blocks * block_size)

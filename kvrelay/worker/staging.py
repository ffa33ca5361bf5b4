"""A step's inputs, from numpy arrays on the host to tensors on the model's device, in one copy.

On the CPU the tensors are the arrays themselves (`torch.from_numpy`, no copy). On a GPU the
int64 inputs (token ids, positions, slots) are packed into one pinned host buffer and the int32
ones (block tables, sequence lengths, query offsets) into another, and each goes over in one
asynchronous copy, so a step pays two transfers however many sequences it holds.

NOTE: a pinned buffer must not be rewritten while its copy may still be in flight (a step that
samples nothing does not wait for the GPU). Two sets of buffers alternate, and before one is
reused the event recorded after its copies is waited for (by then long done, in practice).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvrelay.attention.metadata import DeviceInputs, StepBatch


@dataclass
class _Pinned:
    int64: torch.Tensor
    int32: torch.Tensor
    copied: torch.cuda.Event | None = None  # recorded after the last copies out of these buffers


class InputStaging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sets: list[_Pinned] = []
        self._next = 0

    def upload(self, batch: StepBatch, input_ids: np.ndarray) -> torch.Tensor:
        """Put the step's inputs on the device: returns the input ids [T] int64 and sets
        `batch.uploaded` (positions, slots, block tables, lengths, query offsets)."""
        if self.device.type == "cpu":
            batch.uploaded = DeviceInputs(
                positions=torch.from_numpy(batch.positions),
                slot_mapping=torch.from_numpy(batch.slot_mapping),
                block_tables=torch.from_numpy(batch.block_tables),
                seq_lens=torch.from_numpy(batch.seq_lens),
                query_start_loc=torch.from_numpy(batch.query_start_loc))
            return torch.from_numpy(input_ids)
        return self._upload_pinned(batch, input_ids)

    def _upload_pinned(self, batch: StepBatch, input_ids: np.ndarray) -> torch.Tensor:
        num_longs, num_ints = packed_sizes(batch, len(input_ids))
        pinned = self._buffers(num_longs, num_ints)
        long_host, int_host = pack_inputs(batch, input_ids, pinned.int64, pinned.int32)
        longs = long_host.to(self.device, non_blocking=True)
        ints = int_host.to(self.device, non_blocking=True)
        pinned.copied = torch.cuda.Event()
        # NOTE: the copies went to this device's current stream, whichever device the calling
        # thread has current: the event marks that stream, not the thread's device's.
        pinned.copied.record(torch.cuda.current_stream(self.device))
        return unpack_inputs(batch, longs, ints)

    def _buffers(self, num_longs: int, num_ints: int) -> _Pinned:
        """The next set of pinned buffers, at least this large, safe to overwrite."""
        if len(self._sets) < 2:
            self._sets.append(_Pinned(_pinned(num_longs, torch.int64), _pinned(num_ints, torch.int32)))
        pinned = self._sets[self._next]
        self._next = 1 - self._next
        if pinned.copied is not None:
            pinned.copied.synchronize()
        if pinned.int64.numel() < num_longs:
            pinned.int64 = _pinned(2 * num_longs, torch.int64)
        if pinned.int32.numel() < num_ints:
            pinned.int32 = _pinned(2 * num_ints, torch.int32)
        return pinned


def packed_sizes(batch: StepBatch, num_tokens: int) -> tuple[int, int]:
    """(int64 elements, int32 elements) a step's packed inputs take."""
    return 3 * num_tokens, batch.block_tables.size + 2 * batch.num_seqs + 1


def pack_inputs(batch: StepBatch, input_ids: np.ndarray, int64_buffer: torch.Tensor,
                int32_buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's inputs packed into the fronts of two host buffers, the layout `unpack_inputs`
    reads: [ids, positions, slots] (3T int64) and [block tables, seq lens, query offsets]
    (S*W + 2S + 1 int32)."""
    long_parts = (input_ids, batch.positions, batch.slot_mapping)  # [T] each
    int_parts = (batch.block_tables.reshape(-1), batch.seq_lens, batch.query_start_loc)  # [S*W, S, S+1]
    return _pack(int64_buffer, long_parts), _pack(int32_buffer, int_parts)


def unpack_inputs(batch: StepBatch, longs: torch.Tensor, ints: torch.Tensor) -> torch.Tensor:
    """Views of the packed inputs (on the device): sets `batch.uploaded`, returns the ids [T]."""
    num_tokens, num_seqs = len(longs) // 3, batch.num_seqs
    width = batch.block_tables.shape[1]
    cells = num_seqs * width
    batch.uploaded = DeviceInputs(
        positions=longs[num_tokens:2 * num_tokens], slot_mapping=longs[2 * num_tokens:],
        block_tables=ints[:cells].view(num_seqs, width), seq_lens=ints[cells:cells + num_seqs],
        query_start_loc=ints[cells + num_seqs:])
    return longs[:num_tokens]


def _pinned(size: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(max(size, 1024), dtype=dtype, pin_memory=True)


def _pack(buffer: torch.Tensor, parts: tuple[np.ndarray, ...]) -> torch.Tensor:
    """Copy `parts` back to back into the front of `buffer`; returns that front."""
    host = buffer.numpy()
    offset = 0
    for part in parts:
        host[offset:offset + len(part)] = part
        offset += len(part)
    return buffer[:offset]

"""Copy plans for transports that copy tensor to tensor (CUDA IPC, host staging): which runs of
blocks and which byte ranges of each block, folded so a read is as few copies as it can be.

A read pairs local block ids with remote ones. Pairs that continue a run on both sides fold into
one run (one copy of its blocks). The byte ranges of a heterogeneous-TP read (one KV head's
K or V each) fold too where they follow each other on both sides, and a range that covers whole
blocks on both sides is a whole-block copy again. Each (run, range) is then one strided copy:
a row per block of `length` bytes, a block apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from kvrelay.kv_transfer.transport.base import ByteRange

if TYPE_CHECKING:
    import torch


class Run(NamedTuple):
    """`num_blocks` blocks from remote block `remote` on into local block `local` on."""

    local: int
    remote: int
    num_blocks: int


def coalesce_runs(local_block_ids: Sequence[int], remote_block_ids: Sequence[int]) -> list[Run]:
    """The pairs as runs, in order; a pair extends the run before it when both ids follow on."""
    runs: list[Run] = []
    for local, remote in zip(local_block_ids, remote_block_ids, strict=True):
        last = runs[-1] if runs else Run(-1, -1, 0)
        if runs and (last.local + last.num_blocks, last.remote + last.num_blocks) == (local, remote):
            runs[-1] = last._replace(num_blocks=last.num_blocks + 1)
        else:
            runs.append(Run(local, remote, 1))
    return runs


def coalesce_ranges(ranges: Sequence[ByteRange] | None, local_block_bytes: int,
                    remote_block_bytes: int) -> list[ByteRange] | None:
    """Checked ranges merged where one ends where the next starts on both sides; None (whole
    blocks) when what is left is one range covering both blocks entirely."""
    if ranges is None:
        return None
    merged: list[ByteRange] = []
    for r in sorted(ranges, key=lambda r: r.local_offset):
        last = merged[-1] if merged else None
        if (last is not None and last.local_offset + last.length == r.local_offset
                and last.remote_offset + last.length == r.remote_offset):
            merged[-1] = last._replace(length=last.length + r.length)
        else:
            merged.append(r)
    whole = ByteRange(0, 0, local_block_bytes)
    if local_block_bytes == remote_block_bytes and merged == [whole]:
        return None
    return merged


class CopyPlan(NamedTuple):
    """What one read copies out of every layer."""

    runs: list[Run]
    ranges: list[ByteRange] | None  # None: whole blocks

    @property
    def num_copies_per_layer(self) -> int:
        return len(self.runs) * (1 if self.ranges is None else len(self.ranges))

    def bytes_per_layer(self, block_bytes: int) -> int:
        per_block = block_bytes if self.ranges is None else sum(r.length for r in self.ranges)
        return sum(run.num_blocks for run in self.runs) * per_block


def plan_copies(local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
                ranges: Sequence[ByteRange] | None, local_block_bytes: int,
                remote_block_bytes: int) -> CopyPlan:
    """The copies of a checked read (see base.check_read and base.check_ranges)."""
    return CopyPlan(coalesce_runs(local_block_ids, remote_block_ids),
                    coalesce_ranges(ranges, local_block_bytes, remote_block_bytes))


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides, in elements, of a contiguous tensor of `shape`."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def block_bytes_view(kv: torch.Tensor) -> torch.Tensor:
    """A contiguous layer [num_blocks, ...] as bytes, one row per block."""
    import torch

    return kv.view(kv.shape[0], -1).view(torch.uint8)  # [num_blocks, block_bytes]


def copy_layer(dst: torch.Tensor, src: torch.Tensor, plan: CopyPlan) -> None:
    """Issue one layer's copies from `src` into `dst` (both [num_blocks, block_bytes] bytes) on
    the current stream; non-blocking where the device allows."""
    for run in plan.runs:
        dst_rows = dst[run.local:run.local + run.num_blocks]  # [num_blocks, local_block_bytes]
        src_rows = src[run.remote:run.remote + run.num_blocks]  # [num_blocks, remote_block_bytes]
        if plan.ranges is None:
            dst_rows.copy_(src_rows, non_blocking=True)
            continue
        for r in plan.ranges:
            dst_rows[:, r.local_offset:r.local_offset + r.length].copy_(
                src_rows[:, r.remote_offset:r.remote_offset + r.length], non_blocking=True)


def copy_layer_to_device(dst: torch.Tensor, src: torch.Tensor, plan: CopyPlan) -> list[torch.Tensor]:
    """`copy_layer` from pinned host `src` to device `dst`, asynchronous also for byte ranges: a
    range of host rows is strided, and torch copies a strided host tensor to a GPU through a
    pageable temporary (a synchronous copy). So each run's ranges are gathered into one pinned
    contiguous buffer on the host, sent in one DMA and scattered on the device. Returns those
    buffers: they must outlive the copies (until an event recorded after them fired)."""
    import torch

    if plan.ranges is None or dst.device.type != "cuda":
        copy_layer(dst, src, plan)
        return []
    width = sum(r.length for r in plan.ranges)
    buffers = []
    for run in plan.runs:
        src_rows = src[run.remote:run.remote + run.num_blocks]  # [num_blocks, remote_block_bytes]
        dst_rows = dst[run.local:run.local + run.num_blocks]  # [num_blocks, local_block_bytes]
        packed = torch.empty(run.num_blocks, width, dtype=torch.uint8, pin_memory=True)  # [num_blocks, width]
        offset = 0
        for r in plan.ranges:
            packed[:, offset:offset + r.length] = src_rows[:, r.remote_offset:r.remote_offset + r.length]
            offset += r.length
        on_device = packed.to(dst.device, non_blocking=True)  # [num_blocks, width]
        offset = 0
        for r in plan.ranges:
            part = on_device[:, offset:offset + r.length]  # [num_blocks, length]
            dst_rows[:, r.local_offset:r.local_offset + r.length].copy_(part)
            offset += r.length
        buffers.append(packed)
    return buffers

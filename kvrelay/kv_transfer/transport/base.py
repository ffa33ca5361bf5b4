"""The transport interface: one-sided block reads (and writes) with notifications.

A transport moves KV blocks from a remote instance's registered KV tensors into local ones.
The side that owns the blocks (P) only registers memory and answers; the side that wants them
(D) issues reads. A read carries a notification string that the owner receives once the read
has completed, which is how P learns it may free the blocks.

KV layout (fixed for the engine): per layer one tensor [num_blocks, 2, H_kv, block_size, D], so
block b of layer l starts at base_address(l) + b * block_bytes and is contiguous. A read moves
whole blocks, or (`ranges`) the same byte ranges out of every block: with tensor parallelism of
different sizes on the two sides, a block of one side holds a different set of KV heads than a
block of the other, and one head's K (or V) is one contiguous range of a block.

Backends: NIXL (UCX; host DRAM here, device memory where there is a GPU), a built-in TCP
backend and Mooncake's Transfer Engine (tcp, or rdma where devices exist). All pull (D asks,
P's side serves the requested blocks); all three also push (`write_blocks`: P writes into
blocks D registered with it; the notification then goes to D), whole blocks or byte ranges of
each, as a read does.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RegionLayout:
    """What a peer needs to address this instance's blocks (sent in the handshake)."""

    layer_names: tuple[str, ...]
    num_blocks: int
    block_bytes: int  # bytes of one block of one layer (K and V)
    base_addresses: tuple[int, ...]  # per layer; informational for TCP, used by NIXL
    device: str = "cpu"


class ByteRange(NamedTuple):
    """`length` bytes at `remote_offset` of a remote block, copied to `local_offset` of the
    paired local block (the same offsets in every block and every layer of the read)."""

    remote_offset: int
    local_offset: int
    length: int


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    ERROR = "error"


class TransferHandle(ABC):
    """One in-flight read. Poll it until DONE or ERROR, then release it."""

    @abstractmethod
    def poll(self) -> TransferState: ...

    @abstractmethod
    def release(self) -> None:
        """Free transport resources; after ERROR the local blocks' contents are undefined."""

    @property
    def error(self) -> str | None:
        return None


class TransportError(RuntimeError):
    """A transport failed in a way the caller can act on (unknown peer, refused connection)."""


class FinishedTransfer(TransferHandle):
    """A read that ended before it started: an empty read whose notification went out (DONE),
    or one that could not start, e.g. from an unknown remote (ERROR with the reason)."""

    def __init__(self, error: str | None = None) -> None:
        self._error = error

    def poll(self) -> TransferState:
        return TransferState.DONE if self._error is None else TransferState.ERROR

    def release(self) -> None:
        pass

    @property
    def error(self) -> str | None:
        return self._error


def describe_kv_caches(kv_caches: dict[str, torch.Tensor]) -> RegionLayout:
    """The layout of per-layer KV tensors [num_blocks, 2, H_kv, block_size, D], checked to be
    contiguous, alike across layers and on one device."""
    if not kv_caches:
        raise ValueError("no KV caches to register")
    tensors = list(kv_caches.values())
    first = tensors[0]
    for name, kv in kv_caches.items():
        if not kv.is_contiguous():
            raise ValueError(f"KV cache of layer {name} must be contiguous to be read block by block")
        if kv.shape != first.shape or kv.dtype != first.dtype or kv.device != first.device:
            raise ValueError(f"KV cache of layer {name} is {tuple(kv.shape)} {kv.dtype} on {kv.device}, "
                             f"unlike the first layer's {tuple(first.shape)} {first.dtype} on {first.device}")
    num_blocks = first.shape[0]
    return RegionLayout(layer_names=tuple(kv_caches), num_blocks=num_blocks,
                        block_bytes=first.numel() * first.element_size() // num_blocks,
                        base_addresses=tuple(kv.data_ptr() for kv in tensors), device=str(first.device))


def check_read(local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
               local_num_blocks: int, remote_num_blocks: int) -> None:
    """Raise ValueError unless the two id lists pair up and every id is inside its pool."""
    if len(local_block_ids) != len(remote_block_ids):
        raise ValueError(f"a read pairs local and remote blocks one to one, got {len(local_block_ids)} "
                         f"local and {len(remote_block_ids)} remote block ids")
    for side, ids, num_blocks in (("local", local_block_ids, local_num_blocks),
                                  ("remote", remote_block_ids, remote_num_blocks)):
        bad = [b for b in ids if not 0 <= b < num_blocks]
        if bad:
            raise ValueError(f"{side} block ids {bad[:8]} are outside the pool of {num_blocks} blocks")


def check_write_ranges(ranges: Sequence[ByteRange] | None, local_block_bytes: int,
                       remote_block_bytes: int) -> list[ByteRange] | None:
    """check_ranges for a write: the same bounds, but no two ranges may overlap in the remote
    block, where a write lands (`local_offset` is in the writer's block, `remote_offset` in the
    receiver's, as for a read)."""
    if ranges is None:
        return check_ranges(None, local_block_bytes, remote_block_bytes)
    flipped = [ByteRange(r[1], r[0], r[2]) for r in ranges]
    checked = check_ranges(flipped, remote_block_bytes, local_block_bytes)
    assert checked is not None
    return [ByteRange(r.local_offset, r.remote_offset, r.length) for r in checked]


def check_layers(layers: Sequence[int] | None, num_layers: int) -> list[int]:
    """The layer indices a push writes (every layer for None); ValueError for one outside the pool."""
    chosen = list(range(num_layers)) if layers is None else list(layers)
    if not all(0 <= layer < num_layers for layer in chosen):
        raise ValueError(f"layers {chosen} are outside 0..{num_layers - 1}")
    return chosen


def check_compatible(local: RegionLayout, remote: RegionLayout) -> None:
    """Raise ValueError unless a remote's blocks can be read into ours: the same layers. Block
    sizes may differ (a tensor-parallel shard of another size); each read checks its ranges."""
    if len(local.layer_names) != len(remote.layer_names):
        raise ValueError(f"remote KV layout has {len(remote.layer_names)} layers, the local one "
                         f"{len(local.layer_names)}")


def check_ranges(ranges: Sequence[ByteRange] | None, local_block_bytes: int,
                 remote_block_bytes: int) -> list[ByteRange] | None:
    """The byte ranges of a read, validated: None (whole blocks) needs equal block sizes; each
    range must be non-empty and inside both blocks, and no two may overlap in the local block."""
    if ranges is None:
        if local_block_bytes != remote_block_bytes:
            raise ValueError(f"a whole-block read needs blocks of one size, got {remote_block_bytes} remote "
                             f"and {local_block_bytes} local bytes: pass the byte ranges to read")
        return None
    checked = [ByteRange(*r) for r in ranges]
    if not checked:
        raise ValueError("a read by byte ranges needs at least one range (None reads whole blocks)")
    for r in checked:
        if r.length <= 0 or r.remote_offset < 0 or r.local_offset < 0:
            raise ValueError(f"byte range {tuple(r)} needs non-negative offsets and a positive length")
        if r.remote_offset + r.length > remote_block_bytes or r.local_offset + r.length > local_block_bytes:
            raise ValueError(f"byte range {tuple(r)} runs past a block ({remote_block_bytes} bytes remote, "
                             f"{local_block_bytes} local)")
    by_local = sorted(checked, key=lambda r: r.local_offset)
    for before, after in zip(by_local, by_local[1:], strict=False):
        if before.local_offset + before.length > after.local_offset:
            raise ValueError(f"byte ranges {tuple(before)} and {tuple(after)} overlap in the local block")
    return checked


def range_copies(local_bases: Sequence[int], remote_bases: Sequence[int], local_block_bytes: int,
                 remote_block_bytes: int, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
                 ranges: Sequence[ByteRange]) -> tuple[list[int], list[int], list[int]]:
    """(local addresses, remote addresses, lengths) of a read by byte ranges: layer by layer,
    block pair by block pair, range by range (the order a stream of the bytes follows)."""
    locals_, remotes, lengths = [], [], []
    for local_base, remote_base in zip(local_bases, remote_bases, strict=True):
        for local, remote in zip(local_block_ids, remote_block_ids, strict=True):
            for r in ranges:
                locals_.append(local_base + local * local_block_bytes + r.local_offset)
                remotes.append(remote_base + remote * remote_block_bytes + r.remote_offset)
                lengths.append(r.length)
    return locals_, remotes, lengths


class WriteGuard(Protocol):
    """What the receiving side of a push admits: a transport that sees each incoming write
    (TCP) asks before it lets bytes land, and says when they did. One-sided transports (NIXL)
    cannot ask; there the writer's own promise (the push lease) keeps late writes out."""

    def admit(self, block_ids: Sequence[int], notification: bytes,
              ranges: Sequence[tuple[int, int]] | None = None) -> str | None:
        """None to accept a write into `block_ids` (then `done` follows), else why not. `ranges`:
        the (offset, length) byte ranges of each block it writes (None: whole blocks)."""

    def landed(self, block_ids: Sequence[int], layers: Sequence[int],
               ranges: Sequence[tuple[int, int]] | None = None) -> None:
        """Every byte of the admitted write is in place (`done` follows); `layers` are indices."""

    def done(self, block_ids: Sequence[int], notification: bytes,
             ranges: Sequence[tuple[int, int]] | None = None) -> None:
        """The admitted write finished (landed or failed): no byte of it arrives later."""


class KVTransport(ABC):
    """A backend that both serves (P) and pulls (D) blocks. Not thread-safe unless noted:
    the connector calls it from the engine thread."""

    name: str
    # NOTE: True where the receiver of a push sees each write land (its write guard's `landed`);
    # one-sided writes (NIXL, Mooncake) land unseen and only their notification says so.
    sees_writes: bool = False

    @abstractmethod
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> RegionLayout:
        """Register the local KV tensors (once) and prepare per-layer block descriptors, so a
        read later only picks block indices. Returns this side's layout for the handshake."""

    @abstractmethod
    def agent_metadata(self) -> bytes:
        """An opaque blob a peer passes to add_remote to reach this side (NIXL agent metadata,
        or host:port for TCP)."""

    @abstractmethod
    def add_remote(self, remote_engine_id: str, agent_metadata: bytes, layout: RegionLayout) -> None:
        """Connect to a peer learnt from the handshake; idempotent per remote engine id."""

    @abstractmethod
    def remove_remote(self, remote_engine_id: str) -> None:
        """Forget a peer (it restarted or died); later reads from it fail."""

    @abstractmethod
    def read_blocks(self, remote_engine_id: str, local_block_ids: Sequence[int],
                    remote_block_ids: Sequence[int], notification: bytes,
                    ranges: Sequence[ByteRange] | None = None) -> TransferHandle:
        """Start reading remote blocks (every layer) into local blocks, pairwise: whole blocks,
        or only `ranges` of each (see ByteRange; the rest of a local block is left as it was).
        The owner receives `notification` once the read completed. An empty list only sends
        the notification. Returns immediately.

        Raises ValueError for a malformed request (lengths differ, a block id out of range, a
        range outside a block: see check_ranges); a read from an unknown or removed remote
        returns a handle already in ERROR."""

    def write_blocks(self, remote_engine_id: str, local_block_ids: Sequence[int],
                     remote_block_ids: Sequence[int], notification: bytes,
                     layers: Sequence[int] | None = None,
                     ranges: Sequence[ByteRange] | None = None) -> TransferHandle:
        """Start writing local blocks into a remote's blocks, pairwise, for the layers given
        (indices into the layer order; None: every layer): whole blocks, or only `ranges` of each
        (`local_offset` in this side's block, `remote_offset` in the remote's; the rest of a
        remote block is left as it was: see check_write_ranges). The remote receives
        `notification` once the write completed (an empty one is not delivered). Returns
        immediately; the same errors as read_blocks."""
        raise NotImplementedError(f"the {self.name} transport cannot push blocks")

    def set_write_guard(self, guard: WriteGuard | None) -> None:
        """Ask `guard` before accepting each incoming write (where the transport sees them)."""
        return None

    def expect_remote_access(self, expecting: bool) -> None:
        """A hint from the owner: whether peers may read or write this side's memory now (P while
        it holds blocks for readers, D while pushes are due). A transport that must poll to serve
        them (NIXL over UCX without RDMA) polls slowly while nothing is expected and none of its
        own transfers is in flight. Until the first call it assumes access is expected."""
        return None

    def stage_for_peers(self, block_ids: Sequence[int]) -> None:
        """The owner's blocks `block_ids` are final (a finished request's, held for readers):
        a transport that serves a copy of them (host staging) starts copying them now."""
        return None

    def wait_staged(self, block_ids: Sequence[int], timeout_s: float) -> bool:
        """Wait until the copies stage_for_peers started for `block_ids` are in place; False
        when one never started or did not finish in time (the reader must not read them)."""
        return True

    @abstractmethod
    def get_notifications(self) -> list[bytes]:
        """Notifications received since the last call (on the owner's side)."""

    @abstractmethod
    def close(self) -> None:
        """Stop threads, deregister memory, close sockets. Idempotent."""

"""Chained block hashes: the identity of a full KV block, stable across processes and runs.

A block's hash covers its parent's hash, so equal hashes mean equal token prefixes, not just
equal blocks. The hash is also the key other instances and storage tiers use to find a block,
which is why it comes from hashlib and never from Python's per-process `hash()`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvrelay.request import Request

BLOCK_HASH_NUM_BYTES = 32  # sha256 digest


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int],
                      extra: bytes | None = None) -> bytes:
    """Hash of one full block: sha256(parent hash, token ids as little-endian int64, extra).

    Every field is length-prefixed, so no two different inputs serialize to the same bytes
    (a missing parent differs from an empty one, a missing `extra` from an empty one).
    """
    hasher = hashlib.sha256(_encode_optional(parent_hash))
    hasher.update(struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids))
    hasher.update(_encode_optional(extra))
    return hasher.digest()


def _encode_optional(value: bytes | None) -> bytes:
    if value is None:
        return b"\x00"
    return b"\x01" + struct.pack("<Q", len(value)) + value


def update_block_hashes(request: Request, block_size: int, extra: bytes | None = None) -> list[bytes]:
    """Extend `request.block_hashes` to cover every full block of `request.all_token_ids`.

    Incremental: only blocks completed since the last call are hashed. `extra` (a salt, e.g.
    a model or tenant id) must be the same on every call for a given request.
    """
    return extend_block_hashes(request.block_hashes, request.all_token_ids, block_size, extra)


def hash_token_blocks(token_ids: Sequence[int], block_size: int, extra: bytes | None = None) -> list[bytes]:
    """The chained hashes of every full block of `token_ids`, exactly as an engine with this
    block size computes them for a prompt: what a router compares with an instance's KV events."""
    return extend_block_hashes([], token_ids, block_size, extra)


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        extra: bytes | None = None) -> list[bytes]:
    """Append to `hashes` (those of the leading blocks of `token_ids`) the hashes of the full
    blocks after them; returns `hashes`."""
    num_full_blocks = len(token_ids) // block_size
    for block_index in range(len(hashes), num_full_blocks):
        parent_hash = hashes[block_index - 1] if block_index > 0 else None
        start = block_index * block_size
        hashes.append(hash_block_tokens(parent_hash, token_ids[start:start + block_size], extra))
    return hashes

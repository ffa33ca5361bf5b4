"""The stored form of one chunk: a self-describing header, then the KV bytes.

    offset 0   magic b"KVRC", version u16, key length u16, fingerprint length u16,
               tail tokens u16 (0: a full chunk; else a prompt's last partial chunk of this many
               tokens), payload length u64, payload checksum u64
    then       the chunk key and the model fingerprint digest (ASCII), zero-padded so the
               payload starts on a 64-byte boundary (tensors viewed over it stay aligned)
    then       the payload: [num_layers, num_blocks, 2, H_kv, block_size, D] KV values, where
               num_blocks is blocks_per_chunk for a full chunk, the blocks a tail spans for a
               tail (the slots of its last block past the prompt hold stale values that no
               reader attends to: a position is written before attention reads it)

A blob is trusted only when every field matches what the reader expects: its key (a file or
value moved under another name), the fingerprint (another model, dtype or block layout), the
tail's token count, the length (truncation) and the checksum (bit rot, torn writes). Anything
else is a ChunkError, which the store turns into a miss: recompute, never wrong KV. The
checksum is the sum (mod 2**64) of the payload's 64-bit words: one pass at memory speed, with
the GIL released, where crc32 cost ~4 ms of a core per 12 MB chunk and slowed decoding. It
detects accidents (bit rot, torn or short writes), not tampering; a store writable by an
adversary needs the instance secret (see docs/connectors.md, "Security of the P/D path").
"""

from __future__ import annotations

import struct

import numpy as np

from kvrelay.kv_transfer.offload.tiers.base import Blob
from kvrelay.utils import cdiv

MAGIC = b"KVRC"
VERSION = 2  # 1 used crc32: such entries are now a miss and get rewritten
# NOTE: the tail-token field took over two pad bytes that version 2 always wrote as zero, so
# every chunk stored before reads as what it is: a full chunk.
_FIXED = struct.Struct("<4sHHHHQQ")
MAX_TAIL_TOKENS = 0xFFFF
_ALIGN = 64
_MASK64 = (1 << 64) - 1


def payload_checksum(payload: memoryview) -> int:
    """Sum (mod 2**64) of the payload's little-endian 64-bit words, plus its tail and length."""
    payload = payload.cast("B")
    whole = payload.nbytes // 8 * 8
    total = int(np.frombuffer(payload[:whole], dtype="<u8").sum(dtype=np.uint64))
    tail = int.from_bytes(bytes(payload[whole:]), "little")
    return (total + tail + payload.nbytes) & _MASK64


class ChunkError(ValueError):
    """A stored blob is not the chunk the reader asked for (corrupt, truncated, foreign)."""


def header_size(key: str, fingerprint: str) -> int:
    raw = _FIXED.size + len(key) + len(fingerprint)
    return cdiv(raw, _ALIGN) * _ALIGN


def encode_chunk(key: str, fingerprint: str, payload: memoryview, tail_tokens: int = 0) -> bytearray:
    """Header + payload in one new buffer (the payload is copied exactly once)."""
    payload = payload.cast("B")
    key_b, fp_b = key.encode("ascii"), fingerprint.encode("ascii")
    start = header_size(key, fingerprint)
    blob = bytearray(start + payload.nbytes)
    _FIXED.pack_into(blob, 0, MAGIC, VERSION, len(key_b), len(fp_b), tail_tokens, payload.nbytes,
                     payload_checksum(payload))
    blob[_FIXED.size:_FIXED.size + len(key_b) + len(fp_b)] = key_b + fp_b
    blob[start:] = payload
    return blob


def seal_chunk(blob: bytearray | memoryview, key: str, fingerprint: str, tail_tokens: int = 0) -> None:
    """Write the header of a blob whose payload is already in place (after header_size bytes, up
    to the end of `blob`): lets a writer gather KV straight into its final buffer, with no second
    copy."""
    key_b, fp_b = key.encode("ascii"), fingerprint.encode("ascii")
    start = header_size(key, fingerprint)
    payload = memoryview(blob)[start:]
    _FIXED.pack_into(blob, 0, MAGIC, VERSION, len(key_b), len(fp_b), tail_tokens, payload.nbytes,
                     payload_checksum(payload))
    blob[_FIXED.size:start] = (key_b + fp_b).ljust(start - _FIXED.size, b"\0")


def decode_chunk(blob: Blob, key: str, fingerprint: str, payload_bytes: int,
                 tail_tokens: int = 0) -> memoryview:
    """The payload of `blob` (a view, not a copy), after checking every header field."""
    view = memoryview(blob)
    if view.nbytes < _FIXED.size:
        raise ChunkError(f"chunk {key}: {view.nbytes} bytes is shorter than a header")
    magic, version, key_len, fp_len, stored_tail, length, checksum = _FIXED.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION:
        raise ChunkError(f"chunk {key}: bad magic/version {magic!r}/{version}")
    names = bytes(view[_FIXED.size:_FIXED.size + key_len + fp_len])
    if names[:key_len] != key.encode("ascii"):
        raise ChunkError(f"chunk {key}: the blob holds chunk {names[:key_len]!r}")
    if names[key_len:] != fingerprint.encode("ascii"):
        raise ChunkError(f"chunk {key}: stored by another model or layout (fingerprint mismatch)")
    if stored_tail != tail_tokens:
        raise ChunkError(f"chunk {key}: holds {_describe(stored_tail)}, expected {_describe(tail_tokens)}")
    start = header_size(key, fingerprint)
    if length != payload_bytes or view.nbytes != start + length:
        raise ChunkError(f"chunk {key}: {view.nbytes - start} payload bytes (header says {length}), "
                         f"expected {payload_bytes}")
    payload = view[start:]
    if payload_checksum(payload) != checksum:
        raise ChunkError(f"chunk {key}: checksum mismatch")
    return payload


def _describe(tail_tokens: int) -> str:
    return f"a tail of {tail_tokens} tokens" if tail_tokens else "a full chunk"

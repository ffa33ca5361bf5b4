"""The stored form of one chunk: a self-describing header, then the KV bytes.

    offset 0   magic b"KVRC", version u16, key length u16, fingerprint length u16, 2 pad bytes,
               payload length u64, payload crc32 u32
    then       the chunk key and the model fingerprint digest (ASCII), zero-padded so the
               payload starts on a 64-byte boundary (tensors viewed over it stay aligned)
    then       the payload: [num_layers, blocks_per_chunk, 2, H_kv, block_size, D] KV values

A blob is trusted only when every field matches what the reader expects: its key (a file or
value moved under another name), the fingerprint (another model, dtype or block layout), the
length (truncation) and the checksum (bit rot, torn writes). Anything else is a ChunkError,
which the store turns into a miss: recompute, never wrong KV. crc32 detects accidents, not
tampering; a store writable by an adversary needs the instance secret (see DESIGN.md 6).
"""

from __future__ import annotations

import struct
import zlib

MAGIC = b"KVRC"
VERSION = 1
_FIXED = struct.Struct("<4sHHH2xQI")
_ALIGN = 64


class ChunkError(ValueError):
    """A stored blob is not the chunk the reader asked for (corrupt, truncated, foreign)."""


def header_size(key: str, fingerprint: str) -> int:
    raw = _FIXED.size + len(key) + len(fingerprint)
    return -(-raw // _ALIGN) * _ALIGN


def encode_chunk(key: str, fingerprint: str, payload: memoryview) -> bytearray:
    """Header + payload in one new buffer (the payload is copied exactly once)."""
    payload = payload.cast("B")
    key_b, fp_b = key.encode("ascii"), fingerprint.encode("ascii")
    start = header_size(key, fingerprint)
    blob = bytearray(start + payload.nbytes)
    _FIXED.pack_into(blob, 0, MAGIC, VERSION, len(key_b), len(fp_b), payload.nbytes, zlib.crc32(payload))
    blob[_FIXED.size:_FIXED.size + len(key_b) + len(fp_b)] = key_b + fp_b
    blob[start:] = payload
    return blob


def seal_chunk(blob: bytearray, key: str, fingerprint: str) -> None:
    """Write the header of a blob whose payload is already in place (after header_size bytes):
    lets a writer gather KV straight into its final buffer, with no second copy."""
    key_b, fp_b = key.encode("ascii"), fingerprint.encode("ascii")
    start = header_size(key, fingerprint)
    payload = memoryview(blob)[start:]
    _FIXED.pack_into(blob, 0, MAGIC, VERSION, len(key_b), len(fp_b), payload.nbytes, zlib.crc32(payload))
    blob[_FIXED.size:start] = (key_b + fp_b).ljust(start - _FIXED.size, b"\0")


def decode_chunk(blob: bytes | bytearray, key: str, fingerprint: str, payload_bytes: int) -> memoryview:
    """The payload of `blob` (a view, not a copy), after checking every header field."""
    view = memoryview(blob)
    if view.nbytes < _FIXED.size:
        raise ChunkError(f"chunk {key}: {view.nbytes} bytes is shorter than a header")
    magic, version, key_len, fp_len, length, crc = _FIXED.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION:
        raise ChunkError(f"chunk {key}: bad magic/version {magic!r}/{version}")
    names = bytes(view[_FIXED.size:_FIXED.size + key_len + fp_len])
    if names[:key_len] != key.encode("ascii"):
        raise ChunkError(f"chunk {key}: the blob holds chunk {names[:key_len]!r}")
    if names[key_len:] != fingerprint.encode("ascii"):
        raise ChunkError(f"chunk {key}: stored by another model or layout (fingerprint mismatch)")
    start = header_size(key, fingerprint)
    if length != payload_bytes or view.nbytes != start + length:
        raise ChunkError(f"chunk {key}: {view.nbytes - start} payload bytes (header says {length}), "
                         f"expected {payload_bytes}")
    payload = view[start:]
    if zlib.crc32(payload) != crc:
        raise ChunkError(f"chunk {key}: checksum mismatch")
    return payload

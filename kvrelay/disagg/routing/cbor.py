"""Canonical CBOR (RFC 8949, section 4.2.1) for the few types a block hash serializes.

vLLM's `sha256_cbor` and `xxhash_cbor` prefix-caching hashes digest the canonical CBOR encoding
of `(parent_hash, token_ids, extra_keys)` (and of the seed string for the first parent). Those
are byte strings, text strings, non-negative and negative integers, tuples and None: this
encoder writes exactly those, in the shortest form canonical CBOR requires, so the proxy needs
no CBOR library to reproduce the hashes.
"""

from __future__ import annotations

import struct
from typing import Any

_UNSIGNED, _NEGATIVE, _BYTES, _TEXT, _ARRAY = 0, 1, 2, 3, 4
_NULL = b"\xf6"
_MAX_UINT64 = (1 << 64) - 1


def dumps(value: Any) -> bytes:
    """The canonical CBOR encoding of `value` (bytes, str, int, tuple or list, None)."""
    out = bytearray()
    _encode(value, out)
    return bytes(out)


def _encode(value: Any, out: bytearray) -> None:
    if value is None:
        out += _NULL
    elif isinstance(value, bool):
        raise TypeError("block hash keys hold no booleans")
    elif isinstance(value, int):
        if value > _MAX_UINT64 or value < -1 - _MAX_UINT64:
            raise ValueError(f"integer {value} needs a CBOR bignum, which block hash keys never hold")
        if value >= 0:
            _head(_UNSIGNED, value, out)
        else:
            _head(_NEGATIVE, -1 - value, out)
    elif isinstance(value, bytes):
        _head(_BYTES, len(value), out)
        out += value
    elif isinstance(value, str):
        encoded = value.encode("utf-8")
        _head(_TEXT, len(encoded), out)
        out += encoded
    elif isinstance(value, (tuple, list)):
        _head(_ARRAY, len(value), out)
        for item in value:
            _encode(item, out)
    else:
        raise TypeError(f"cannot encode {type(value).__name__} as a block hash key")


def _head(major: int, argument: int, out: bytearray) -> None:
    """A data item's first bytes: its major type and the shortest encoding of its argument."""
    if argument < 24:
        out.append(major << 5 | argument)
    elif argument < 1 << 8:
        out += struct.pack(">BB", major << 5 | 24, argument)
    elif argument < 1 << 16:
        out += struct.pack(">BH", major << 5 | 25, argument)
    elif argument < 1 << 32:
        out += struct.pack(">BI", major << 5 | 26, argument)
    else:
        out += struct.pack(">BQ", major << 5 | 27, argument)

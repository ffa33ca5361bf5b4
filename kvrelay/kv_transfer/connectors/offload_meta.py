"""What the OffloadConnector's scheduler side hands its worker side each step, and chunk keys."""

from __future__ import annotations

import hashlib
from array import array

import msgspec

from kvrelay.kv_transfer.base import KVConnectorMetadata


class ChunkLoad(msgspec.Struct):
    key: str
    first_block: int  # the chunk's block that lands in block_ids[0]
    block_ids: list[int]  # local blocks to fill, in token order


class LoadJob(msgspec.Struct):
    req_id: str
    chunks: list[ChunkLoad]
    load_async: bool  # False: done inside this step, before the forward


class ChunkSave(msgspec.Struct):
    req_id: str
    key: str
    block_ids: list[int]  # every block of the chunk, in token order


class OffloadConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = msgspec.field(default_factory=list)
    saves: list[ChunkSave] = msgspec.field(default_factory=list)


def chunk_keys(token_ids: list[int], chunk_tokens: int, fingerprint: str) -> list[str]:
    """One key per full chunk: a chained hash of every token up to the chunk's end, rooted in
    the model fingerprint and the chunk size, so two models or layouts never share a key."""
    parent = hashlib.sha256(f"{fingerprint}:{chunk_tokens}".encode()).digest()
    keys = []
    for start in range(0, len(token_ids) - chunk_tokens + 1, chunk_tokens):
        digest = hashlib.sha256(parent)
        digest.update(array("q", token_ids[start:start + chunk_tokens]).tobytes())
        parent = digest.digest()
        keys.append(parent.hex()[:40])
    return keys

"""What the OffloadConnector's scheduler side hands its worker side each step, and chunk keys."""

from __future__ import annotations

import hashlib
from array import array
from typing import NamedTuple

import msgspec

from kvrelay.kv_transfer.base import KVConnectorMetadata


class ChunkLoad(msgspec.Struct):
    key: str
    first_block: int  # the entry's block that lands in block_ids[0]
    block_ids: list[int]  # local blocks to fill, in token order
    tail_tokens: int = 0  # 0: a full chunk; else a prompt's last partial chunk of this many tokens


class LoadJob(msgspec.Struct):
    req_id: str
    chunks: list[ChunkLoad]
    load_async: bool  # False: done inside this step, before the forward


class ChunkSave(msgspec.Struct):
    req_id: str
    key: str
    block_ids: list[int]  # every block of the entry, in token order
    tail_tokens: int = 0  # as in ChunkLoad


class OffloadConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = msgspec.field(default_factory=list)
    saves: list[ChunkSave] = msgspec.field(default_factory=list)


class PromptKeys(NamedTuple):
    """The store keys of one prompt: one per full chunk, and one for its tail (the tokens past
    the last full chunk) when storing the tail can save computing something."""

    chunks: list[str]
    tail: str | None
    tail_tokens: int  # tokens the tail entry covers; 0 when there is none

    @property
    def all(self) -> list[str]:
        """Every key in token order, as the lookup asks for them."""
        return self.chunks + [self.tail] if self.tail else self.chunks


def _root(chunk_tokens: int, fingerprint: str) -> bytes:
    return hashlib.sha256(f"{fingerprint}:{chunk_tokens}".encode()).digest()


def chunk_keys(token_ids: list[int], chunk_tokens: int, fingerprint: str) -> list[str]:
    """One key per full chunk: a chained hash of every token up to the chunk's end, rooted in
    the model fingerprint and the chunk size, so two models or layouts never share a key."""
    return prompt_keys(token_ids, chunk_tokens, fingerprint, with_tail=False).chunks


def prompt_keys(token_ids: list[int], chunk_tokens: int, fingerprint: str,
                with_tail: bool = True) -> PromptKeys:
    """The full chunks' keys (see chunk_keys) and the tail's: the hash of the last full chunk's
    key, the tail's token count and its tokens, so a tail entry is served only to a prompt with
    exactly this token prefix.

    NOTE: a tail of one token gets no key. The last prompt token is always computed again (its
    logits give the first output token), so loading it would save nothing."""
    parent = _root(chunk_tokens, fingerprint)
    keys = []
    num_full = len(token_ids) // chunk_tokens * chunk_tokens
    for start in range(0, num_full, chunk_tokens):
        digest = hashlib.sha256(parent)
        digest.update(array("q", token_ids[start:start + chunk_tokens]).tobytes())
        parent = digest.digest()
        keys.append(parent.hex()[:40])
    tail_tokens = len(token_ids) - num_full
    if not with_tail or tail_tokens < 2:
        return PromptKeys(keys, None, 0)
    digest = hashlib.sha256(parent)
    digest.update(f"tail:{tail_tokens}:".encode())
    digest.update(array("q", token_ids[num_full:]).tobytes())
    return PromptKeys(keys, digest.hexdigest()[:40], tail_tokens)

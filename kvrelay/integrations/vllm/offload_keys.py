"""The offload store's keys of a vLLM request, from vLLM's own block hashes.

vLLM hashes each full block of `hash_block_size` tokens, chained over the whole prefix, with the
request's extra keys (cache_salt, LoRA, multimodal inputs) folded in, so a block hash names one
exact prefix as vLLM's prefix cache sees it. With the default sha256 hashing and PYTHONHASHSEED
unset, vLLM seeds the chain with a fixed value ("vllm-none-hash", vllm/v1/core/kv_cache_utils.py
in 0.32.0): every instance of a model computes the same hashes, which is what lets two instances
share prefixes through Redis or Mooncake Store. With PYTHONHASHSEED set, instances share only if
they set the same value; a non-cryptographic hash (xxhash) without it is seeded at random per
process: then entries are never found by another process (a miss, never wrong KV).

    chunk c   sha256(root, the hash of the chunk's last block)           root = the compatibility
    tail      sha256(root, the hash of the prompt's last full block,     digest and the chunk size
              the tokens after it, cache_salt, LoRA name)

A tail (the tokens past the last full chunk) is keyed only without multimodal inputs: its
placeholder tokens do not say which image they stand for.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import TYPE_CHECKING

from kvrelay.kv_transfer.offload.meta import PromptKeys

if TYPE_CHECKING:
    from kvrelay.integrations.vllm.translate import VllmRequestView
    from kvrelay.request import Request


class VllmBlockHashKeyer:
    """A PromptKeyer (kvrelay/kv_transfer/offload/scheduler.py) over vLLM's block hashes."""

    def __init__(self, chunk_tokens: int, fingerprint: str, hash_block_size: int) -> None:
        if chunk_tokens % hash_block_size:
            raise ValueError(f"chunk_tokens {chunk_tokens} must be a multiple of vLLM's hash block size "
                             f"{hash_block_size} (its --block-size)")
        self.chunk_tokens = chunk_tokens
        self.hash_block_size = hash_block_size
        self.root = hashlib.sha256(f"vllm-block-hashes:{fingerprint}:{chunk_tokens}".encode()).digest()

    def request_keys(self, request: Request) -> PromptKeys:
        view: VllmRequestView = request  # type: ignore[assignment]  # the adapter passes its view
        hashes, num_prompt = view.block_hashes, view.num_prompt_tokens
        per_chunk = self.chunk_tokens // self.hash_block_size
        num_chunks = min(num_prompt // self.chunk_tokens, len(hashes) // per_chunk)
        chunks = [self._key(hashes[(c + 1) * per_chunk - 1]) for c in range(num_chunks)]
        tail_tokens = num_prompt - num_chunks * self.chunk_tokens
        if tail_tokens < 2 or view.has_multimodal_inputs or num_chunks < num_prompt // self.chunk_tokens:
            return PromptKeys(chunks, None, 0)
        num_full = min(num_prompt // self.hash_block_size, len(hashes))
        digest = hashlib.sha256(self.root)
        digest.update(hashes[num_full - 1] if num_full else b"")
        digest.update(f"tail:{tail_tokens}:{num_full * self.hash_block_size}:{view.cache_salt}:"
                      f"{view.lora_name}:".encode())
        digest.update(array("q", view.prompt_token_ids[num_full * self.hash_block_size:]).tobytes())
        return PromptKeys(chunks, digest.hexdigest()[:40], tail_tokens)

    def token_keys(self, token_ids: list[int]) -> PromptKeys | None:
        return None  # tokens alone lack vLLM's extra keys

    def _key(self, block_hash: bytes) -> str:
        return hashlib.sha256(self.root + bytes(block_hash)).hexdigest()[:40]

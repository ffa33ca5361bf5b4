"""A request's prompt as the instances will see it: its token ids and its blocks' hashes.

The proxy tokenizes with the model's own tokenizer and the server's own code
(kvrelay.entrypoints.prompt_tokens), then hashes full blocks with the engine's own function
(kvrelay.core.block_hash), so a hash here is the hash an instance publishes for those tokens.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any

from kvrelay.core.block_hash import hash_token_blocks

if TYPE_CHECKING:
    from kvrelay.model.tokenizer import Tokenizer


class PromptBlocks:
    """One prompt's token ids (None when the proxy cannot know them) and, per block size, the
    chained hashes of its full blocks, computed on first use."""

    def __init__(self, token_ids: list[int] | None) -> None:
        self.token_ids = token_ids
        self._hashes: dict[int, list[bytes]] = {}

    @property
    def hashable(self) -> bool:
        return self.token_ids is not None

    @cached_property
    def num_tokens(self) -> int:
        return len(self.token_ids) if self.token_ids is not None else 0

    def block_hashes(self, block_size: int) -> list[bytes]:
        if self.token_ids is None:
            return []
        if block_size not in self._hashes:
            self._hashes[block_size] = hash_token_blocks(self.token_ids, block_size)
        return self._hashes[block_size]

    def max_hit_blocks(self, block_size: int) -> int:
        """An engine's prefix hit stops short of the last token (it is computed for the logits)."""
        return max(0, self.num_tokens - 1) // block_size


class PromptReader:
    """Turns a request body into PromptBlocks with the model's tokenizer (no weights)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def read(self, route: str, body: dict[str, Any]) -> PromptBlocks:
        if self.tokenizer is None:
            return PromptBlocks(None)
        from kvrelay.entrypoints.prompt_tokens import request_prompt_token_ids

        return PromptBlocks(request_prompt_token_ids(self.tokenizer, route, body))

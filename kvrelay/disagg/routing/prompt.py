"""A request's prompt as the instances will see it: its token ids and its blocks' hashes.

The proxy tokenizes with the model's own tokenizer and the server's own code
(kvrelay.entrypoints.prompt_tokens), then hashes full blocks the way the instance does
(routing/hash_schemes.py: kvrelay's kvrelay.core.block_hash, or vLLM's), so a hash here is the
hash an instance publishes for those tokens.
"""

from __future__ import annotations

import logging
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any

from kvrelay.disagg.routing.hash_schemes import KVRELAY_SCHEME, BlockHashScheme

if TYPE_CHECKING:
    import httpx

    from kvrelay.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# What the proxy and an instance must tokenize alike (the chat template included).
TOKENIZER_PROBES = (
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "kvrelay: the KV cache, 1 2 3!"}]}),
    ("/v1/completions", {"prompt": "kvrelay: the KV cache, 1 2 3!"}),
)


class PromptBlocks:
    """One prompt's token ids (None when the proxy cannot know them) and, per hash scheme and
    block size, the chained hashes of its full blocks, computed on first use. `cache_salt` is
    the request's (vLLM salts the first block's hash with it)."""

    def __init__(self, token_ids: list[int] | None, cache_salt: str | None = None) -> None:
        self.token_ids = token_ids
        self.cache_salt = cache_salt
        self._hashes: dict[tuple[str, int], list[bytes]] = {}

    @property
    def hashable(self) -> bool:
        return self.token_ids is not None

    @cached_property
    def num_tokens(self) -> int:
        return len(self.token_ids) if self.token_ids is not None else 0

    def block_hashes(self, block_size: int, scheme: BlockHashScheme = KVRELAY_SCHEME) -> list[bytes]:
        if self.token_ids is None:
            return []
        key = (scheme.key, block_size)
        if key not in self._hashes:
            self._hashes[key] = scheme.chain(self.token_ids, block_size, cache_salt=self.cache_salt)
        return self._hashes[key]

    def max_hit_blocks(self, block_size: int) -> int:
        """An engine's prefix hit stops short of the last token (it is computed for the logits)."""
        return max(0, self.num_tokens - 1) // block_size


class PromptReader:
    """Turns a request body into PromptBlocks with the model's tokenizer (no weights)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def for_model(cls, model: str | None, tokenizer: Tokenizer | None = None) -> PromptReader:
        """With `tokenizer`, or `model`'s (None: the default model's). Without one (the default
        model's cannot be loaded) prompts are not hashed; an explicit model that fails is an error."""
        if tokenizer is not None:
            return cls(tokenizer)
        try:
            return cls(_shared_tokenizer(model))
        except (FileNotFoundError, ValueError) as e:
            if model is not None:
                raise
            logger.warning("kv-aware routing: no tokenizer (%s); pass --model: routing by load", e)
            return cls(None)

    async def agrees_with(self, client: httpx.AsyncClient, urls: list[str], headers: dict[str, str],
                          timeout: float) -> bool:
        """Whether the instances tokenize as this reader does: the first one whose /tokenize
        answers the probes must give the same tokens. A different model would never match a
        prefix: the caller then routes by load (this says why in the log)."""
        if self.tokenizer is None:
            return True
        for url in urls:
            answers = [await _tokenize(client, url, probe, headers, timeout) for _, probe in TOKENIZER_PROBES]
            if any(a is None for a in answers):
                continue  # this instance cannot tell (no /tokenize, no chat template): the next
            if answers != [self.read(route, probe).token_ids for route, probe in TOKENIZER_PROBES]:
                logger.warning("kv-aware routing: %s tokenizes differently from the proxy's tokenizer "
                               "(pass the served model as --model): routing by load", url)
                return False
            return True
        return True

    def read(self, route: str, body: dict[str, Any]) -> PromptBlocks:
        if self.tokenizer is None:
            return PromptBlocks(None)
        from kvrelay.entrypoints.prompt_tokens import request_prompt_token_ids

        salt = body.get("cache_salt")
        return PromptBlocks(request_prompt_token_ids(self.tokenizer, route, body),
                            salt if isinstance(salt, str) and salt else None)


@lru_cache(maxsize=4)
def _shared_tokenizer(model: str | None) -> Tokenizer:
    """One tokenizer per model and process: reading a GGUF's vocabulary takes seconds, and every
    proxy (the tests build hundreds) would pay it again. A failed load is not remembered."""
    from kvrelay.model.loader import load_tokenizer

    return load_tokenizer(model)


async def _tokenize(client: httpx.AsyncClient, url: str, probe: dict[str, Any], headers: dict[str, str],
                    timeout: float) -> list[int] | None:
    import httpx

    try:
        answer = await client.post(url + "/tokenize", json=probe, headers=headers, timeout=timeout)
        tokens = answer.json().get("tokens") if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return tokens if isinstance(tokens, list) else None

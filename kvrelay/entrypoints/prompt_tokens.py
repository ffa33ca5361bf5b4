"""From an OpenAI request to the prompt's token ids: one definition for the server and the proxy.

`kvrelay serve` tokenizes what it serves with these functions, and the P/D proxy uses the same
ones (with the model's tokenizer, no weights) to hash a prompt's blocks before it picks an
instance. Both must agree token for token, or the proxy's prefix predictions are wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvrelay.entrypoints.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ValidationError,
)
from kvrelay.model.tokenizer import Tokenizer


def chat_prompt_text(tokenizer: Tokenizer, messages: Sequence[ChatMessage],
                     add_generation_prompt: bool) -> str:
    """The conversation rendered by the model's chat template (ValueError if it cannot be)."""
    return str(tokenizer.apply_chat_template([m.as_template_input() for m in messages],
                                             add_generation_prompt=add_generation_prompt))


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
    """A prompt's token ids: text is encoded, token ids are taken as they are."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    return list(prompt)


def request_prompt_token_ids(tokenizer: Tokenizer, route: str, body: dict[str, Any]) -> list[int] | None:
    """The token ids the server computes for the one prompt of `body` sent to `route`, or None
    where they cannot be known without the server: an invalid body (the server will refuse
    it), a list of prompts, or truncate_prompt_tokens (it depends on the server's context)."""
    try:
        if route.endswith("/chat/completions"):
            chat = ChatCompletionRequest.model_validate(body)
            if chat.truncate_prompt_tokens is not None:
                return None
            text = chat_prompt_text(tokenizer, chat.messages, chat.add_generation_prompt)
            return encode_prompt(tokenizer, text, chat.add_special_tokens)
        completion = CompletionRequest.model_validate(body)
        prompts = completion.prompts()
        if len(prompts) != 1 or completion.truncate_prompt_tokens is not None:
            return None
        return encode_prompt(tokenizer, prompts[0], completion.add_special_tokens)
    except (ValidationError, ValueError):
        return None

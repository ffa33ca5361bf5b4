"""Tokenizer: a `tokenizers.Tokenizer` plus the ids and chat template the engine needs.

The same class serves GGUF files (built from metadata by `gguf_loader`) and Hugging Face
directories (`tokenizer.json` + `tokenizer_config.json`). `save(dir)` writes the Hugging Face
layout, so a saved tokenizer is also readable by `transformers.AutoTokenizer`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Tokens that close a chat turn. A chat model stops on these even when the file's eos differs.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


class Tokenizer:
    """Text <-> token ids, special ids, stop ids and chat formatting for one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        chat_template: str | None = None,
        extra_stop_token_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self._extra_stop_token_ids = frozenset(int(i) for i in extra_stop_token_ids)

    # ----- ids ---------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of tokens marked special (control tokens); `decode` skips them by default."""
        added = self.backend.get_added_tokens_decoder()
        return frozenset(i for i, tok in added.items() if tok.special)

    @cached_property
    def stop_token_ids(self) -> frozenset[int]:
        """eos, the chat template's end-of-turn token (if it writes one), and any extra eos ids."""
        stop = set(self._extra_stop_token_ids)
        if self.eos_token_id is not None:
            stop.add(self.eos_token_id)
        for text in END_OF_TURN_TOKENS:
            token_id = self.backend.token_to_id(text)
            if token_id is not None and self.chat_template and text in self.chat_template:
                stop.add(token_id)
        return frozenset(stop)

    def id_to_token(self, token_id: int) -> str:
        token = self.backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return str(token)

    def token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.id_to_token(token_id)

    # ----- text --------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special-token text (e.g. "<|im_start|>") maps to its single id;
        `add_special_tokens` adds what the model adds around a sequence (e.g. Llama 3's BOS)."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    # ----- chat --------------------------------------------------------------------------------
    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render a conversation to the prompt text the model was trained on."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead of messages")
        _check_messages(messages)
        return self._compiled_template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.token_text(self.bos_token_id) or "",
            eos_token=self.token_text(self.eos_token_id) or "",
            **kwargs,
        )

    def set_chat_template(self, template: str) -> None:
        """Use `template` instead of the model's own (`--chat-template`); ValueError when it is
        not a valid Jinja template. Its end-of-turn token, if it writes one, stops generation."""
        compile_chat_template(template)
        self.chat_template = template
        for derived in ("_compiled_template", "stop_token_ids"):
            self.__dict__.pop(derived, None)

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        assert self.chat_template is not None
        return compile_chat_template(self.chat_template)

    # ----- persistence -------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` (Hugging Face layout) into `directory`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.token_text(self.bos_token_id),
            "eos_token": self.token_text(self.eos_token_id),
            "chat_template": self.chat_template,
        }
        text = json.dumps({k: v for k, v in config.items() if v is not None}, indent=1, ensure_ascii=False)
        (directory / "tokenizer_config.json").write_text(text, encoding="utf-8")

    @classmethod
    def load(cls, directory: str | Path, extra_stop_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Read a tokenizer saved by `save` or by transformers (`tokenizer.json` is required;
        the chat template comes from `tokenizer_config.json` or `chat_template.jinja`)."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{directory}: no tokenizer.json (kvrelay needs a fast tokenizer file)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:
            raise ValueError(f"{path}: cannot read tokenizer ({e})") from e
        config = _read_json(directory / "tokenizer_config.json")
        template = config.get("chat_template")
        jinja_path = directory / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text(encoding="utf-8")
        if isinstance(template, list):  # several named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(
            backend,
            bos_token_id=_token_id(backend, config.get("bos_token")),
            eos_token_id=_token_id(backend, config.get("eos_token")),
            chat_template=template,
            extra_stop_token_ids=extra_stop_token_ids,
        )


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        kind = type(messages).__name__
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got {kind}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {message!r}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"message {i} has no 'role' string: {dict(message)!r}")
        if "content" not in message and "tool_calls" not in message:
            raise ValueError(f"message {i} has no 'content': {dict(message)!r}")


def compile_chat_template(template: str) -> jinja2.Template:
    """A chat template compiled as Hugging Face renders them (sandboxed); ValueError naming the
    line of a syntax error."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template is not valid Jinja (line {e.lineno}: {e.message})") from None


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _tojson(value: Any, indent: int | None = None) -> str:
    # Templates expect non-ASCII text to stay readable, unlike jinja's default tojson.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    return data if isinstance(data, dict) else {}


def _token_id(backend: tokenizers.Tokenizer, token: Any) -> int | None:
    """Id of a special token given as text or as transformers' AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    token_id = backend.token_to_id(token)
    return None if token_id is None else int(token_id)

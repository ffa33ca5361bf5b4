"""Request bodies of the OpenAI-compatible routes, and their translation to SamplingParams.

Bodies are validated strictly (no "5" for an int), so a wrong type is a 400 naming the field.
Unknown fields are ignored, as clients send extras (`user`, vendor options) freely. Field names
follow OpenAI's and vLLM's, so bodies written for vLLM (and its P/D proxies) work unchanged.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvrelay.sampling_params import MAX_LOGPROBS, SamplingParams

__all__ = ["ChatCompletionRequest", "CompletionRequest", "ValidationError", "check_kv_transfer_params",
           "describe_validation_error"]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool | None = False


class _SamplingFields(BaseModel):
    """Fields shared by both routes."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None  # None: the served model
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    # kvrelay / vLLM extensions
    kv_transfer_params: dict[str, Any] | None = None
    request_id: str | None = None

    def _sampling_kwargs(self) -> dict[str, Any]:
        optional = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                    "frequency_penalty", "repetition_penalty")
        kwargs = {name: getattr(self, name) for name in optional if getattr(self, name) is not None}
        kwargs.update(n=self.n, stop=self.stop, stop_token_ids=self.stop_token_ids,
                      ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
                      include_stop_str_in_output=self.include_stop_str_in_output,
                      skip_special_tokens=self.skip_special_tokens)
        return kwargs

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    # A string, a list of token ids, or a list holding one of those (n=1, one prompt per request).
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError(f"prompt: kvrelay takes one prompt per request, got a list of {len(prompt)}")
            return prompt[0]  # type: ignore[return-value]
        return prompt  # type: ignore[return-value]

    def to_sampling_params(self) -> SamplingParams:
        for name, unsupported in (("echo", self.echo), ("suffix", self.suffix is not None),
                                  ("best_of", self.best_of not in (None, 1))):
            if unsupported:
                raise ValueError(f"{name} is not supported by kvrelay; leave it unset")
        return SamplingParams(max_tokens=self.max_tokens, logprobs=self.logprobs, **self._sampling_kwargs())


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None

    def as_template_input(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # content parts: only text is understood
            texts = []
            for i, part in enumerate(self.content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages: content part {i} must be {{'type': 'text', 'text': str}}, "
                                     f"got {part!r} (kvrelay serves text-only models)")
                texts.append(part["text"])
            message["content"] = "".join(texts)
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs needs logprobs=true")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **self._sampling_kwargs())


# Known kv_transfer_params keys (DESIGN.md section 5) and their types; other keys pass through.
_KV_PARAM_TYPES: dict[str, tuple[type, ...]] = {
    "do_remote_decode": (bool,), "do_remote_prefill": (bool,), "remote_engine_id": (str,),
    "remote_request_id": (str,), "remote_host": (str,), "remote_port": (int,), "tp_size": (int,),
    "remote_num_tokens": (int,), "remote_block_ids": (list,),
}


def check_kv_transfer_params(params: dict[str, Any] | None) -> None:
    """Reject wrong types in the known keys here, so a bad body never reaches a connector."""
    if params is None:
        return
    for key, types in _KV_PARAM_TYPES.items():
        value = params.get(key)
        if value is None:
            continue
        wrong_int = isinstance(value, bool) and bool not in types  # True is not a port
        if wrong_int or not isinstance(value, types):
            names = " or ".join(t.__name__ for t in types)
            raise ValueError(f"kv_transfer_params.{key} must be {names} or null, got {value!r}")
        if isinstance(value, list) and not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in value):
            raise ValueError(f"kv_transfer_params.remote_block_ids must be a list of block ids "
                             f"(ints >= 0), got {value!r}")
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise ValueError(f"kv_transfer_params.{key} must be >= 0, got {value!r}")


# What a field with several accepted types takes, for messages clearer than pydantic's.
_UNION_FIELDS = {
    "prompt": "a string, a list of token ids, or a list holding one of those",
    "stop": "a string, a list of strings, or null",
    "content": "a string or a list of {'type': 'text', 'text': ...} parts",
}


def describe_validation_error(error: ValidationError) -> tuple[str, str]:
    """(message, param) for the first problem pydantic found, naming the field."""
    first = error.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if not _is_union_branch(p)]
    param = ".".join(loc) or "body"
    if loc and loc[-1] in _UNION_FIELDS and first.get("type") != "missing":
        return f"{param} must be {_UNION_FIELDS[loc[-1]]}, got {first.get('input')!r}", param
    message = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        return f"{param}: field required", param
    got = first.get("input")
    return f"{param}: {message}, got {got!r}" if not isinstance(got, dict) else f"{param}: {message}", param


def _is_union_branch(part: Any) -> bool:
    # pydantic adds the tried union member ("str", "list[int]", "function-after[...]") to the loc.
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)

"""Request bodies of the OpenAI-compatible routes, and their translation to SamplingParams.

Bodies are validated strictly (no "5" for an int), so a wrong type is a 400 naming the field.
Unknown fields are ignored, as clients send extras (`user`, vendor options) freely. Field names
follow OpenAI's and vLLM's, so bodies written for vLLM (and its P/D proxies) work unchanged.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvrelay.sampling_params import MAX_LOGPROBS, SamplingParams

__all__ = ["ChatCompletionRequest", "CompletionRequest", "DetokenizeRequest", "TokenizeRequest",
           "ValidationError", "check_kv_transfer_params", "describe_validation_error"]

# vLLM request fields kvrelay does not implement, and the values that mean "not used". Any other
# value is refused with a 400 rather than silently ignored (ignoring logit_bias or a grammar
# would return an answer the client did not ask for).
_UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}), "allowed_token_ids": (None,), "bad_words": (None, []),
    "use_beam_search": (None, False), "prompt_logprobs": (None,), "logprob_token_ids": (None,),
    "response_format": (None, {"type": "text"}), "priority": (None, 0), "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "prompt_embeds": (None,), "continue_final_message": (None, False), "tools": (None,),
    "tool_choice": (None, "none", "auto"), "suffix": (None,),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage so far in every chunk


class _SamplingFields(BaseModel):
    """Fields shared by both routes."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None  # None: the served model
    n: int | None = 1
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
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # kvrelay / vLLM extensions
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the last N (-1: all that fit)
    kv_transfer_params: dict[str, Any] | None = None
    request_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_kvrelay_does_not_do(cls, body: Any) -> Any:
        if not isinstance(body, dict):
            return body
        for name, unused in _UNSUPPORTED_FIELDS.items():
            value = body.get(name)
            if not any(value == u and type(value) is type(u) for u in unused):
                raise _FieldError(name, f"{name}={value!r} is not supported by kvrelay; leave it unset")
        if body.get("stream_options") and not body.get("stream"):
            raise _FieldError("stream_options", "stream_options can only be set when stream=true")
        return body

    def _sampling_kwargs(self) -> dict[str, Any]:
        optional = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                    "frequency_penalty", "repetition_penalty")
        kwargs = {name: getattr(self, name) for name in optional if getattr(self, name) is not None}
        kwargs.update(n=1 if self.n is None else self.n, stop=self.stop, stop_token_ids=self.stop_token_ids,
                      ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
                      include_stop_str_in_output=self.include_stop_str_in_output,
                      skip_special_tokens=self.skip_special_tokens)
        return kwargs

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage
                    and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    # A string, a list of token ids, or a list of either (one choice per prompt, times n).
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # null means the default, as in vLLM
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    add_special_tokens: bool = True

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return list(prompt)  # type: ignore[arg-type]
        return [prompt]  # type: ignore[list-item]

    @property
    def max_output_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens=0: the prompt comes back and nothing is generated (vLLM)."""
        return bool(self.echo) and self.max_output_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        n = 1 if self.n is None else self.n
        if self.best_of is not None and self.best_of not in (1, n):
            raise ValueError(f"best_of={self.best_of} is not supported by kvrelay (vLLM's V1 engine dropped "
                             f"it too); leave it unset, or ask for n={self.best_of} choices")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs needs the prompt's log-probabilities, which kvrelay does "
                             "not compute; drop logprobs or echo")
        max_tokens = 1 if self.echo_only else self.max_output_tokens
        return SamplingParams(max_tokens=max_tokens, logprobs=self.logprobs, **self._sampling_kwargs())


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
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # vLLM: the chat template adds the model's special tokens, so encoding adds none by default.
    add_special_tokens: bool = False
    echo: bool = False  # vLLM: prepend the last message's content when it has the reply's role

    @property
    def max_tokens_param(self) -> tuple[int | None, str]:
        """The output limit and the field it came from (max_completion_tokens wins)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def echo_text(self) -> str:
        """What `echo` prepends to each choice: the last message's text if the reply continues
        its role (always without a generation prompt, only an assistant's with one)."""
        last = self.messages[-1]
        if not self.echo or (self.add_generation_prompt and last.role != "assistant"):
            return ""
        return str(last.as_template_input().get("content") or "")

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
            if self.top_logprobs > 0 and not self.logprobs:
                raise ValueError("top_logprobs needs logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(max_tokens=self.max_tokens_param[0], logprobs=logprobs,
                              **self._sampling_kwargs())


class TokenizeRequest(BaseModel):
    """POST /tokenize: a prompt, or chat messages rendered with the chat template (vLLM's shapes)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages (vLLM)
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' (a string) or 'messages' (a chat)")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[int]


# Known kv_transfer_params keys and their types (docs/disaggregation.md, "What P offers and what D
# reads"); other keys pass through.
_KV_PARAM_TYPES: dict[str, tuple[type, ...]] = {
    "do_remote_decode": (bool,), "do_remote_prefill": (bool,), "remote_engine_id": (str,),
    "remote_request_id": (str,), "remote_host": (str,), "remote_port": (int,), "tp_size": (int,),
    "remote_num_tokens": (int,), "remote_block_ids": (list,), "transfer_mode": (str,), "transfer_id": (str,),
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
    if params.get("transfer_mode") not in (None, "pull", "push"):
        raise ValueError(f"kv_transfer_params.transfer_mode must be 'pull' or 'push', "
                         f"got {params['transfer_mode']!r}")


class _FieldError(ValueError):
    """A refusal from a model validator that names its field (pydantic reports such errors at
    the body's top level; describe_validation_error puts the field back)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# What a field with several accepted types takes, for messages clearer than pydantic's.
_UNION_FIELDS = {
    "prompt": "a string, a list of token ids, or a list of strings or of token-id lists",
    "stop": "a string, a list of strings, or null",
    "content": "a string or a list of {'type': 'text', 'text': ...} parts",
}


def describe_validation_error(error: ValidationError) -> tuple[str, str]:
    """(message, param) for the first problem pydantic found, naming the field."""
    first = error.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, _FieldError):
        return str(cause), cause.param
    if first.get("type") == "value_error" and not first.get("loc"):
        return str(cause or first.get("msg", "invalid value")), "body"
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

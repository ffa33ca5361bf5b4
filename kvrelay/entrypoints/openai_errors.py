"""OpenAI's error shape, shared by `kvrelay serve`, the proxy and its admin API:

    {"error": {"message": "...", "type": "BadRequestError", "param": "temperature", "code": 400}}

`type` follows the status (the `openai` client's exception names); `param` names the field at
fault, or null. FastAPI's own errors (an unknown route, a wrong method) get the same shape
through `add_error_handlers`.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "MethodNotAllowedError", 409: "ConflictError",
               422: "UnprocessableEntityError", 500: "InternalServerError", 502: "BadGatewayError",
               503: "ServiceUnavailableError"}


class APIError(Exception):
    """An error answer: raise it from a route, the handler turns it into the response."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param,
                      "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def context_error(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str,
                  max_param: str = "max_tokens") -> APIError | None:
    """vLLM's refusal (and wording) of a prompt that leaves no room for one output token, or of a
    `max_tokens` the context cannot hold after the prompt; None when it fits. `kvrelay serve`
    refuses with it, and the proxy before the prefill leg (D would refuse after P computed)."""
    if num_prompt_tokens >= max_model_len:
        return APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, "
                             f"your request has {num_prompt_tokens} input tokens. Please reduce the length "
                             f"of the input {param}.", param)
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        return APIError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                             f"model's maximum context length is {max_model_len} tokens and your request has "
                             f"{num_prompt_tokens} input tokens ({max_tokens} > {max_model_len} - "
                             f"{num_prompt_tokens}).", max_param)
    return None


async def read_json_object(request: Request) -> dict[str, Any]:
    """The request's body as a JSON object; APIError 400 (param "body") otherwise."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", "body") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", "body")
    return body


def add_error_handlers(app: FastAPI) -> None:
    """APIError, and FastAPI's own 404 / 405 answers, in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail), headers=getattr(e, "headers", None))

"""OpenAI error JSON and the FastAPI exception handlers that produce it.

Every failure a client can see has the shape ``{"error": {"message", "type", "param", "code"}}``:
validation problems (ours, pydantic's, the engine's) are 400, an unknown model is 404, overload
is 429 with Retry-After, anything unexpected is 500 — never FastAPI's default 422 or HTML.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from baton_serve.router.protocol import ErrorInfo, ErrorResponse
from baton_serve.workers.errors import InvalidRequestError, OutOfBlocksError, OverloadedError, WorkerLostError
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                 405: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields; raise it anywhere in a handler."""

    def __init__(self, status_code: int, message: str, type: str | None = None, param: str | None = None,
                 code: int | str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.headers = headers
        self.message = message
        self.type = type or _STATUS_TYPES.get(status_code, "server_error" if status_code >= 500
                                              else "invalid_request_error")
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The OpenAI error object, as sent in a response or an SSE ``data:`` event."""
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception to the error the client sees; unexpected ones become a logged 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):  # includes ContextLengthExceededError
        return APIError(400, exc.message, param=exc.param)
    if isinstance(exc, OutOfBlocksError):
        return APIError(400, str(exc), param="prompt")
    if isinstance(exc, OverloadedError):
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        return APIError(429, str(exc), headers={"Retry-After": retry})
    if isinstance(exc, WorkerLostError):
        return APIError(503, str(exc), type="server_error")
    if isinstance(exc, RequestValidationError):
        return validation_error(exc)
    logger.error("request failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


def validation_error(exc: RequestValidationError | ValidationError) -> APIError:
    """Pydantic's error list as one 400: the first offending field is the ``param``."""
    errors = list(exc.errors())
    if not errors:
        return APIError(400, "invalid request body")
    params, parts = [], []
    for err in errors[:3]:
        param = _loc_to_param(err.get("loc", ()))
        params.append(param)
        if err.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON: {err.get('msg', '')}")
        elif err.get("type") == "extra_forbidden":
            parts.append(f"{param}: not supported by this server (it would be ignored, so the request is refused)")
        else:
            parts.append(f"{param or 'body'}: {err.get('msg', 'invalid value')}")
    return APIError(400, "; ".join(parts), param=params[0])


def _loc_to_param(loc: Any) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_union_tag(str(part)):
            out += f".{part}" if out else str(part)
    return out or None


def _is_union_tag(part: str) -> bool:
    # pydantic names the union member that failed ("str", "list[int]", "function-after[...]");
    # field names never look like that.
    return "[" in part or "-" in part or part in ("str", "int", "float", "bool", "dict", "list")


def install_error_handlers(app: FastAPI) -> None:
    """Make every error response OpenAI-shaped."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        return to_api_error(exc).response()

    async def on_http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return APIError(exc.status_code, str(exc.detail)).response()

    for cls in (APIError, InvalidRequestError, OutOfBlocksError, OverloadedError, RequestValidationError,
                Exception):
        app.add_exception_handler(cls, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)

"""Request ids for logs: taken from ``X-Request-Id`` (or made), echoed back, and on every log line
written while the request is handled (``--log-format json`` prints it as a field)."""

from __future__ import annotations

import contextvars
import json
import logging
import re
import time
import uuid
from typing import Any

HEADER = b"x-request-id"
# What a client may send: what proxies (nginx $request_id, Envoy, a UUID) put there, nothing that
# could forge a log line.
_VALID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")

current: contextvars.ContextVar[str | None] = contextvars.ContextVar("baton_request_id", default=None)


def request_id_from(value: bytes | None) -> str:
    """The client's id when it is a sane one, else a fresh one."""
    if value is not None:
        text = value.decode("latin-1")
        if _VALID.fullmatch(text):
            return text
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """Raw ASGI, outermost: sets the request's id for everything under it (the gate, the handlers,
    the tasks they start) and adds it to the response headers, refusals included."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id_from(dict(scope.get("headers") or ()).get(HEADER))

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, rid.encode())]}
            await send(message)

        token = current.set(rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current.reset(token)


class RequestIdFilter(logging.Filter):
    """Puts the current request's id (or None) on every record as ``record.request_id``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = current.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request_id, and the exception."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
               + f".{int(record.msecs):03d}Z", "level": record.levelname, "logger": record.name,
               "message": record.getMessage(), "request_id": getattr(record, "request_id", None)}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(log_format: str = "text", level: int = logging.INFO) -> None:
    """The process's root handler in ``log_format`` (text or json), every record carrying its
    request id; replaces a handler set earlier (a Ray worker's, a previous call's)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_baton", False)]:
        root.removeHandler(old)
    handler._baton = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)

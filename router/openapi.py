"""OpenAPI documentation for routes that parse their own body.

The completion routes take ``request: Request`` and validate the JSON themselves (any
Content-Type, OpenAI-style 400s), so FastAPI knows nothing of their body. :func:`json_body`
gives such a route the keyword arguments that document it anyway; nothing about how requests
are handled changes.
"""

from __future__ import annotations

from typing import Any

from baton_serve.router.protocol import ErrorResponse
from fastapi import FastAPI
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"
_ERRORS = {
    400: "Invalid request: bad JSON, an unknown or unsupported field, a value out of range, or too long "
         "for the context",
    401: "Missing or invalid API key",
    404: "The model does not exist",
    429: "Overloaded; retry after the number of seconds in Retry-After",
    503: "The server is not ready",
}


def json_body(app: FastAPI, model: type[BaseModel]) -> dict[str, Any]:
    """Keyword arguments for ``app.post(...)`` that declare ``model`` as the required JSON body and
    the OpenAI error responses.

    The model's JSON schema and its ``$defs`` join ``components/schemas`` (refs rewritten to point
    there) whenever ``app`` builds its document; a name already taken by another schema is an error.
    """
    schema = model.model_json_schema(ref_template=_REF)
    _add_components(app, {**schema.pop("$defs", {}), model.__name__: schema})
    body = {"required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}}
    stream = {"200": {"content": {"text/event-stream": {"schema": {"type": "string"}}}}}  # with stream=true
    return {"openapi_extra": {"requestBody": body, "responses": stream},
            "responses": {status: {"model": ErrorResponse, "description": text} for status, text in _ERRORS.items()}}


def _add_components(app: FastAPI, schemas: dict[str, Any]) -> None:
    extra: dict[str, Any] | None = getattr(app.state, "openapi_schemas", None)
    if extra is None:
        extra = app.state.openapi_schemas = {}
        build = app.openapi

        def openapi() -> dict[str, Any]:
            # FastAPI caches the document it builds; merging into it again is a no-op.
            doc = build()
            _merge(doc.setdefault("components", {}).setdefault("schemas", {}), extra)
            return doc

        app.openapi = openapi  # type: ignore[method-assign]
    _merge(extra, schemas)


def _merge(into: dict[str, Any], schemas: dict[str, Any]) -> None:
    for name, schema in schemas.items():
        if into.setdefault(name, schema) != schema:
            raise ValueError(f"two different OpenAPI schemas are named {name!r}")

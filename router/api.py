"""The FastAPI application: OpenAI routes plus health, readiness and metrics.

Build one with :func:`build_app`; everything it needs is passed in, nothing is global, so a
process (or a test) can run several apps side by side.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from router.engine_client import EngineClient
from router.errors import APIError, install_error_handlers, validation_error
from router.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from router.serving import OpenAIServing
from workers.text.tokenizer import Tokenizer


def build_app(client: EngineClient, tokenizer: Tokenizer, model_name: str, max_model_len: int,
              ready: Callable[[], bool] | None = None, metrics_registry: Any = None,
              queue_size: int = 64, on_startup: Sequence[Callable[[], Any]] = (),
              on_shutdown: Sequence[Callable[[], Any]] = ()) -> FastAPI:
    """An OpenAI-compatible app serving ``model_name`` through ``client``.

    ``ready`` gates ``GET /ready`` (None: ready as soon as the app serves). ``GET /metrics`` exists
    only when a ``prometheus_client`` registry is given. ``queue_size`` bounds the deltas buffered
    per request between the engine and a slow SSE reader. ``on_startup``/``on_shutdown`` callables
    (plain or async) run on the server's event loop in the ASGI lifespan, in order.
    """

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for hook in on_startup:
            await _call(hook)
        try:
            yield
        finally:
            for hook in on_shutdown:
                await _call(hook)

    app = FastAPI(title="Baton", summary="OpenAI-compatible LLM serving", lifespan=lifespan)
    serving = OpenAIServing(client, tokenizer, model_name, max_model_len, queue_size=queue_size)
    app.state.serving = serving
    install_error_handlers(app)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(await _parse(request, ChatCompletionRequest), request)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await serving.completions(await _parse(request, CompletionRequest), request)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return serving.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        card = serving.models().data[0]
        if model_id != card.id:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return card

    @app.get("/health")
    async def health() -> dict[str, str]:
        # Liveness only: answering at all is the signal.
        return {"status": "ok"}

    @app.get("/ready", response_model=None)
    async def readiness() -> JSONResponse:
        if ready is not None and not ready():
            return APIError(503, "the server is not ready yet").response()
        return JSONResponse({"status": "ready"})

    if metrics_registry is not None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _call(hook: Callable[[], Any]) -> None:
    result = hook()
    if inspect.isawaitable(result):
        await result


Body = TypeVar("Body", bound=BaseModel)


async def _parse(request: Request, model: type[Body]) -> Body:
    """The JSON body as ``model`` whatever the Content-Type (curl -d sends a form type); 400 if bad."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None

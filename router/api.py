"""The FastAPI application: OpenAI routes plus health, readiness and metrics.

Build one with :func:`build_app`; everything it needs is passed in, nothing is global, so a
process (or a test) can run several apps side by side.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from baton_serve.router.engine_client import EngineClient
from baton_serve.router.errors import APIError, install_error_handlers
from baton_serve.router.gateway import GateMiddleware, Gateway
from baton_serve.router.openapi import json_body
from baton_serve.router.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from baton_serve.router.request_id import RequestIdMiddleware
from baton_serve.router.serving import OpenAIServing
from baton_serve.workers.text.tokenizer import Tokenizer
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response


def build_app(client: EngineClient, tokenizer: Tokenizer, model_name: str | Sequence[str], max_model_len: int,
              ready: Callable[[], bool] | None = None, metrics_registry: Any = None,
              queue_size: int = 64, on_startup: Sequence[Callable[[], Any]] = (),
              on_shutdown: Sequence[Callable[[], Any]] = (), gateway: Gateway | None = None,
              admin: Callable[[str | None], bool] | None = None, protect_probes: bool = False,
              status: Callable[[], dict[str, Any]] | None = None,
              metrics_text: Callable[[], Awaitable[bytes]] | None = None) -> FastAPI:
    """An OpenAI-compatible app serving ``model_name`` through ``client``.

    ``ready`` gates ``GET /ready`` (None: ready as soon as the app serves); a draining gate makes
    it 503 too. ``GET /metrics`` exists only when a ``prometheus_client`` registry is given.
    ``queue_size`` bounds the deltas buffered per request between the engine and a slow SSE reader.
    ``gateway`` admits requests (``router.gateway``; None: everyone, no idempotency). ``admin``
    checks an ``Authorization`` header for ``/metrics`` (and, with ``protect_probes``, ``/health``
    and ``/ready``); None leaves them open. ``on_startup``/``on_shutdown`` callables (plain or
    async) run on the server's event loop in the ASGI lifespan, in order. ``status`` serves
    ``GET /status`` (admin only, like ``/metrics``) and adds a workers summary to ``/ready``.
    ``metrics_text`` replaces the registry's own exposition on ``/metrics`` (several fronts: the
    whole deployment's, ``cluster.metrics_merge``).
    """
    gateway = gateway or Gateway()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for hook in on_startup:
            await _call(hook)
        try:
            yield
        finally:
            await gateway.close()
            for hook in on_shutdown:
                await _call(hook)

    app = FastAPI(title="Baton", summary="OpenAI-compatible LLM serving", lifespan=lifespan)
    serving = OpenAIServing(client, tokenizer, model_name, max_model_len, queue_size=queue_size)
    app.state.serving = serving
    install_error_handlers(app)

    @app.post("/v1/chat/completions", response_model=None, **json_body(app, ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await gateway.handle(request, ChatCompletionRequest, serving.chat, "chat")

    @app.post("/v1/completions", response_model=None, **json_body(app, CompletionRequest))
    async def completions(request: Request) -> Response:
        return await gateway.handle(request, CompletionRequest, serving.completions, "completion")

    @app.get("/v1/models")
    async def models() -> ModelList:
        return serving.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        for card in serving.models().data:  # each served name (alias) has its card
            if card.id == model_id:
                return card
        raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")

    def check_admin(request: Request, protected: bool) -> None:
        if protected and admin is not None and not admin(request.headers.get("authorization")):
            raise APIError(401, "this endpoint needs an admin API key", headers={"WWW-Authenticate": "Bearer"})

    @app.get("/health")
    async def health(request: Request) -> dict[str, str]:
        # Liveness only: answering at all is the signal.
        check_admin(request, protect_probes)
        return {"status": "ok"}

    @app.get("/ready", response_model=None)
    async def readiness(request: Request) -> JSONResponse:
        check_admin(request, protect_probes)
        if gateway.gate is not None and gateway.gate.draining:
            return APIError(503, "the server is shutting down").response()
        summary = _workers_summary(status()) if status is not None else None
        if ready is not None and not ready():
            err = APIError(503, "the server is not ready yet" if summary is None
                           else f"the server is not ready: {summary['alive']} of {summary['total']} workers alive")
            return err.response()
        return JSONResponse({"status": "ready"} if summary is None else {"status": "ready", "workers": summary})

    if status is not None:
        @app.get("/status")
        async def cluster_status(request: Request) -> JSONResponse:
            check_admin(request, True)
            return JSONResponse(status())

    if metrics_registry is not None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        @app.get("/metrics")
        async def metrics(request: Request) -> Response:
            check_admin(request, True)
            body = await metrics_text() if metrics_text is not None else generate_latest(metrics_registry)
            return Response(body, media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(GateMiddleware, gateway=gateway,
                       paths={"/v1/chat/completions": "chat", "/v1/completions": "completion"})
    app.add_middleware(RequestIdMiddleware)  # added last, so outermost: refusals carry the id too
    return app


def _workers_summary(status: dict[str, Any]) -> dict[str, Any]:
    """What ``/ready`` tells a probe: counts, restarts and who is quarantined, not the loads."""
    workers = status.get("workers", [])
    return {"alive": sum(w["alive"] for w in workers), "total": len(workers),
            "restarts": sum(w["restarts"] for w in workers),
            "quarantined": [w["worker_id"] for w in workers if w["quarantined"]]}


async def _call(hook: Callable[[], Any]) -> None:
    result = hook()
    if inspect.isawaitable(result):
        await result

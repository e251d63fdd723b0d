"""A real HTTP server over the tiny model: engine + AsyncEngine + app + uvicorn on 127.0.0.1."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

import pytest
from baton_serve.router.api import build_app
from baton_serve.router.server import ServerThread
from baton_serve.workers.engine.async_engine import AsyncEngine, EngineStats
from baton_serve.workers.engine.config import EngineConfig
from baton_serve.workers.engine.core import EngineCore
from baton_serve.workers.llm import build_engine
from baton_serve.workers.text.tokenizer import Tokenizer
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter

MODEL = "tiny-llama"
NUM_BLOCKS = 128


@dataclass
class Backend:
    engine: EngineCore
    tokenizer: Tokenizer
    client: AsyncEngine
    server: ServerThread
    ready: threading.Event
    generated: Counter  # request id -> tokens the engine produced for it

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def base_url(self) -> str:
        return self.server.url + "/v1"


def wait_idle(client: AsyncEngine, timeout: float = 5.0) -> EngineStats:
    """Poll until nothing runs or waits and every KV block is free; return the last stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        idle = stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == stats.num_blocks
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


@pytest.fixture(scope="module")
def backend(tiny_model_dir) -> Backend:
    engine, tokenizer, _ = build_engine(EngineConfig(model=str(tiny_model_dir), dtype="float32",
                                                     block_size=8, num_kv_blocks=NUM_BLOCKS))
    generated: Counter = Counter()

    def on_step(deltas) -> None:  # engine thread; Counter updates are atomic enough under the GIL
        for d in deltas:
            generated[d.request_id] += len(d.token_ids)

    client = AsyncEngine(engine, on_step=on_step)
    ready = threading.Event()
    registry = CollectorRegistry()
    PromCounter("baton_test_requests", "a metric so /metrics has content", registry=registry).inc()
    app = build_app(client, tokenizer, MODEL, engine.max_model_len, ready=ready.is_set,
                    metrics_registry=registry)
    server = ServerThread(app).start()
    yield Backend(engine, tokenizer, client, server, ready, generated)
    server.stop()
    client.shutdown()

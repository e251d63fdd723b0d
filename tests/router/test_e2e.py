"""End to end on the embedded SmolLM2-135M-Instruct: the official SDK, streaming, over HTTP."""

from __future__ import annotations

import openai
import pytest
from baton_serve.router.api import build_app
from baton_serve.router.server import ServerThread
from baton_serve.workers.engine.async_engine import AsyncEngine
from baton_serve.workers.engine.config import EngineConfig
from baton_serve.workers.llm import build_engine

from tests.router.conftest import wait_idle

NUM_BLOCKS = 256


@pytest.mark.e2e
def test_capital_of_france_streams_paris(default_model_dir):
    engine, tokenizer, folder = build_engine(EngineConfig(model=str(default_model_dir), dtype="bfloat16",
                                                          num_kv_blocks=NUM_BLOCKS))
    client = AsyncEngine(engine)
    try:
        app = build_app(client, tokenizer, folder.name, engine.max_model_len)
        with ServerThread(app) as server:
            sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)
            stream = sdk.chat.completions.create(
                model=folder.name, messages=[{"role": "user", "content": "What is the capital of France?"}],
                temperature=0, max_tokens=20, stream=True, stream_options={"include_usage": True})
            chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert "Paris" in text, text
        assert chunks[-1].usage is not None and 0 < chunks[-1].usage.completion_tokens <= 20
        stats = wait_idle(client)
        assert stats.num_running == 0 and stats.num_free_blocks == NUM_BLOCKS
    finally:
        client.shutdown()

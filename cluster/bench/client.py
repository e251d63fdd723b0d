"""One streamed request against an OpenAI-compatible server, timed chunk by chunk.

The first *text-bearing* chunk is the first token: a chat stream's opening role chunk and a
final usage chunk carry no text and are not emissions. Token counts come from
``stream_options.include_usage``; without it they fall back to the number of text chunks. The
same usage carries ``prompt_tokens_details.cached_tokens`` when the server reports prefix-cache hits.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from baton_serve.cluster.bench.metrics import RequestRecord
from baton_serve.cluster.bench.prompts import Prompt

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send: ``path`` is COMPLETIONS or CHAT; ``token_ids`` sends completions
    prompts as token ids when the prompt has them; ``extra_body`` is merged into every body."""

    base_url: str
    model: str
    path: str = COMPLETIONS
    ignore_eos: bool = True
    temperature: float = 0.0
    token_ids: bool = True
    timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.path

    def body(self, prompt: Prompt, max_tokens: int) -> dict[str, Any]:
        """The JSON body: streamed, usage included, ``max_tokens`` and (vLLM-style) ``ignore_eos``."""
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": max_tokens, "temperature": self.temperature,
            "stream": True, "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.path == CHAT:
            messages = [{"role": "user", "content": prompt.user if prompt.user is not None else prompt.text}]
            if prompt.system is not None:
                messages.insert(0, {"role": "system", "content": prompt.system})
            body["messages"] = messages
        else:
            use_ids = self.token_ids and prompt.token_ids is not None
            body["prompt"] = prompt.token_ids if use_ids else prompt.text
        body.update(self.extra_body)
        return body


def _chunk_text(data: dict[str, Any]) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def cached_tokens(usage: dict[str, Any]) -> int | None:
    """``prompt_tokens_details.cached_tokens`` of a ``usage`` object (a streamed final chunk's or a
    non-streamed response's: the same shape); None when absent, null or not a count (unknown, not 0)."""
    details = usage.get("prompt_tokens_details")
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


async def send(client: httpx.AsyncClient, endpoint: Endpoint, prompt: Prompt, record: RequestRecord,
               t0: float) -> RequestRecord:
    """Stream one request, filling ``record`` (whose ``t_scheduled``/``t_ready`` the caller set).

    Times are ``perf_counter() - t0``. Never raises for server or network errors: they end up in
    ``record.error`` with ``ok`` False.
    """
    body = endpoint.body(prompt, record.expected_output_len)
    usage: dict[str, Any] | None = None
    chunks = 0
    record.t_sent = time.perf_counter() - t0
    try:
        async with client.stream("POST", endpoint.url, json=body, timeout=endpoint.timeout_s) as resp:
            record.status = resp.status_code
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                record.error = f"HTTP {resp.status_code}: {text[:300]}"
                return record
            async for line in resp.aiter_lines():
                now = time.perf_counter() - t0
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    record.error = f"stream error: {json.dumps(data['error'])[:300]}"
                    return record
                if _chunk_text(data):
                    record.emit_times.append(now)
                    chunks += 1
                if data.get("usage"):
                    usage = data["usage"]
    except (httpx.HTTPError, ValueError, OSError) as e:
        record.error = f"{type(e).__name__}: {e}"[:300]
        return record
    finally:
        record.t_end = time.perf_counter() - t0
    if usage is not None:
        record.output_tokens = int(usage.get("completion_tokens") or 0)
        record.prompt_len = int(usage.get("prompt_tokens") or record.prompt_len)
        record.cached_tokens = cached_tokens(usage)
    else:
        record.output_tokens = chunks
    record.ok = chunks > 0
    if not record.ok:
        record.error = "the stream carried no text"
    return record


async def fetch_model_name(base_url: str, timeout_s: float = 10.0) -> str:
    """The first model ``GET /v1/models`` lists; ConnectionError with the URL when unreachable."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            resp = await client.get(url)
            resp.raise_for_status()
            models = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        raise ConnectionError(f"cannot list models at {url}: {e}") from e
    if not models:
        raise ConnectionError(f"{url} lists no models")
    return str(models[0]["id"])

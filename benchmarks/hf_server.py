"""The plain ``transformers`` baseline behind an OpenAI-compatible completions API.

One background thread does *static batching*: it takes up to ``--max-batch`` waiting requests,
left-pads them into one batch, decodes token by token over a ``DynamicCache`` (each step's tokens
are streamed at once), and finishes the whole batch before taking the next. No continuous
batching, no paged cache: what a plain Hugging Face server does.

    .venv/bin/python benchmarks/hf_server.py --port 8001 [--model FOLDER] [--threads 2] [--max-batch 64]
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import Request  # module level: FastAPI resolves the handler's annotation by name

Event = tuple["GenRequest", int, str | None]  # (request, token id, finish reason or None)


@dataclass(eq=False)
class GenRequest:
    """One completion in flight; the batch thread fills ``out`` (token ids, then None at the end)."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = False
    out: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    finish_reason: str | None = None
    error: str | None = None
    cancelled: bool = False


def sample(logits: torch.Tensor, temps: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """One token per row: argmax where the temperature is 0, else temperature + top-p sampling."""
    greedy = logits.argmax(-1)
    if not bool((temps > 0).any()):
        return greedy
    probs = torch.softmax(logits.float() / temps.clamp(min=1e-5)[:, None], -1)
    sorted_p, idx = probs.sort(-1, descending=True)
    drop = sorted_p.cumsum(-1) - sorted_p > top_ps[:, None]  # keep the smallest set reaching top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    sampled = idx.gather(-1, torch.multinomial(sorted_p, 1)).squeeze(-1)
    return torch.where(temps > 0, sampled, greedy)


@torch.inference_mode()
def run_batch(model: Any, reqs: list[GenRequest], pad_id: int, eos_ids: set[int],
              emit: Callable[[list[Event]], None]) -> None:
    """Generate for ``reqs`` as one left-padded batch until every row is done; ``emit`` gets each
    step's new tokens. Finished rows keep occupying the batch (static batching)."""
    from transformers import DynamicCache

    n, width = len(reqs), max(len(r.prompt_ids) for r in reqs)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, r in enumerate(reqs):
        ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    temps = torch.tensor([r.temperature for r in reqs])
    top_ps = torch.tensor([r.top_p for r in reqs])
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    counts, done = [0] * n, [False] * n
    for _ in range(max(r.max_tokens for r in reqs)):
        nxt = sample(out.logits[:, -1], temps, top_ps)
        events: list[Event] = []
        for i, tok in enumerate(nxt.tolist()):
            r = reqs[i]
            if done[i] or r.cancelled:
                done[i] = True
                continue
            counts[i] += 1
            reason = "stop" if not r.ignore_eos and tok in eos_ids else (
                "length" if counts[i] >= r.max_tokens else None)
            done[i] = reason is not None
            events.append((r, tok, reason))
        emit(events)
        if all(done):
            return
        mask = torch.cat([mask, mask.new_ones((n, 1))], dim=1)
        pos = pos[:, -1:] + 1
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)


class StaticBatcher:
    """Owns the model thread: ``submit`` may be called from the event loop; tokens come back on it."""

    def __init__(self, model: Any, pad_id: int, eos_ids: set[int], max_batch: int,
                 batch_wait_s: float, loop: asyncio.AbstractEventLoop) -> None:
        self.model, self.pad_id, self.eos_ids = model, pad_id, eos_ids
        self.max_batch, self.batch_wait_s, self.loop = max_batch, batch_wait_s, loop
        self.waiting: queue.Queue[GenRequest] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hf-static-batcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def submit(self, req: GenRequest) -> None:
        self.waiting.put(req)

    def _emit(self, events: list[Event]) -> None:
        self.loop.call_soon_threadsafe(_deliver, events)

    def _take(self) -> list[GenRequest]:
        """Up to ``max_batch`` waiting requests; after the first, wait briefly for a burst to land."""
        try:
            batch = [self.waiting.get(timeout=0.1)]
        except queue.Empty:
            return []
        deadline = time.monotonic() + self.batch_wait_s
        while len(batch) < self.max_batch:
            try:
                batch.append(self.waiting.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        return [r for r in batch if not r.cancelled]

    def _loop(self) -> None:
        while not self._stop.is_set():
            batch = self._take()
            if not batch:
                continue
            try:
                run_batch(self.model, batch, self.pad_id, self.eos_ids, self._emit)
            except Exception as e:  # a failed batch fails its requests, not the server
                for r in batch:
                    r.error = f"{type(e).__name__}: {e}"
                self._emit([(r, -1, "error") for r in batch])


def _deliver(events: list[Event]) -> None:
    for req, tok, reason in events:
        if tok >= 0:
            req.out.put_nowait(tok)
        if reason is not None:
            req.finish_reason = reason
            req.out.put_nowait(None)


class Detokenizer:
    """Incremental text for one output: holds back an incomplete UTF-8 tail (vLLM's offsets trick)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        after = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever text is still held back (at the end of the output)."""
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        after = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        self.prefix = self.read = len(self.ids)
        return after[len(before):]


def _error(status: int, message: str, kind: str = "invalid_request_error") -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}})


def create_app(model_dir: str | Path, *, dtype: str = "bfloat16", max_batch: int = 64,
               batch_wait_ms: float = 20.0, served_model_name: str | None = None) -> Any:
    """The FastAPI app; the model loads now, the batch thread starts with the app (lifespan)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    name = served_model_name or model_dir.name
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    eos_ids = {i for i in ([gen_eos] if isinstance(gen_eos, int) else gen_eos or []) if i is not None}
    if tok.eos_token_id is not None:
        eos_ids.add(tok.eos_token_id)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else min(eos_ids, default=0)
    max_len = int(getattr(model.config, "max_position_embeddings", 2048))
    state: dict[str, StaticBatcher] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state["b"] = StaticBatcher(model, pad_id, eos_ids, max_batch, batch_wait_ms / 1e3,
                                   asyncio.get_running_loop())
        state["b"].start()
        yield
        state["b"].stop()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "transformers",
                                            "max_model_len": max_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a one-element batch
        if isinstance(prompt, str):
            ids = tok(prompt)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            return _error(400, "prompt must be a string or a non-empty list of token ids")
        if body.get("model") not in (None, name):
            return _error(404, f"model {body.get('model')!r} does not exist", "not_found_error")
        if int(body.get("n") or 1) != 1:
            return _error(400, "n must be 1")
        max_tokens = int(body.get("max_tokens") or 16)
        temperature = float(body["temperature"]) if body.get("temperature") is not None else 1.0
        top_p = float(body.get("top_p") or 1.0)
        if max_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
            return _error(400, "need max_tokens >= 1, temperature >= 0, 0 < top_p <= 1")
        if len(ids) + max_tokens > max_len:
            return _error(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds {max_len}")
        req = GenRequest(ids, max_tokens, temperature, top_p, bool(body.get("ignore_eos", False)))
        state["b"].submit(req)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        usage_wanted = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(text: str, reason: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": created, "model": name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}

        def usage(n_out: int) -> dict[str, int]:
            return {"prompt_tokens": len(ids), "completion_tokens": n_out, "total_tokens": len(ids) + n_out}

        async def tokens() -> AsyncIterator[int]:
            while (t := await req.out.get()) is not None:
                yield t

        if not body.get("stream"):
            detok, text, n_out = Detokenizer(tok), [], 0
            async for t in tokens():
                text.append(detok.add(t))
                n_out += 1
            if req.error:
                return _error(500, req.error, "server_error")
            resp = chunk("".join(text) + detok.flush(), req.finish_reason)
            resp["usage"] = usage(n_out)
            return resp

        async def sse() -> AsyncIterator[str]:
            import json

            detok, n_out = Detokenizer(tok), 0
            try:
                async for t in tokens():
                    n_out += 1
                    if text := detok.add(t):
                        yield f"data: {json.dumps(chunk(text, None))}\n\n"
            finally:
                req.cancelled = req.finish_reason is None  # the client left: its row stops early
            if req.error:
                yield f"data: {json.dumps({'error': {'message': req.error, 'type': 'server_error'}})}\n\n"
            else:
                yield f"data: {json.dumps(chunk(detok.flush(), req.finish_reason))}\n\n"
                if usage_wanted:
                    yield f"data: {json.dumps({**chunk('', None), 'choices': [], 'usage': usage(n_out)})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app


def main(argv: list[str] | None = None) -> int:
    """Load the model, then serve on loopback until SIGINT/SIGTERM."""
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF folder (default: the converted default model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--max-batch", type=int, default=64, help="requests per static batch")
    p.add_argument("--batch-wait-ms", type=float, default=20.0,
                   help="after the first request, wait this long for more to fill the batch")
    p.add_argument("--served-model-name", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from baton_serve.workers.checkpoint.default_model import default_model_path

        model = str(default_model_path())
    started = time.monotonic()
    app = create_app(model, dtype=args.dtype, max_batch=args.max_batch, batch_wait_ms=args.batch_wait_ms,
                     served_model_name=args.served_model_name)
    print(f"hf_server: {Path(model).name} loaded in {time.monotonic() - started:.1f}s, "
          f"http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    import sys

    sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: see tests/conftest.py
    raise SystemExit(main())

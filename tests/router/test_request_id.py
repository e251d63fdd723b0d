"""X-Request-Id: taken from the client when sane, made otherwise, echoed back on every answer
(refusals too), and on each log line written while the request is handled."""

from __future__ import annotations

import io
import json
import logging

import httpx
import pytest
from baton_serve.router.api import build_app
from baton_serve.router.request_id import (
    JsonFormatter,
    RequestIdFilter,
    configure_logging,
    current,
    request_id_from,
)
from baton_serve.router.server import ServerThread

from tests.router.conftest import MODEL


@pytest.fixture
def served(backend):
    app = build_app(backend.client, backend.tokenizer, MODEL, 512)
    seen: list[str | None] = []

    @app.get("/probe")
    async def probe() -> dict:
        logging.getLogger("baton.test").warning("handling the probe")
        seen.append(current.get())
        return {}

    server = ServerThread(app).start()
    yield server.url, seen
    server.stop()


def test_the_clients_id_is_echoed_and_logged(served, caplog):
    url, seen = served
    caplog.handler.addFilter(RequestIdFilter())
    with caplog.at_level(logging.WARNING, logger="baton.test"):
        r = httpx.get(url + "/probe", headers={"X-Request-Id": "req-42.a"})
    assert r.headers["x-request-id"] == "req-42.a" and seen == ["req-42.a"]
    (record,) = [r for r in caplog.records if r.name == "baton.test"]
    assert record.request_id == "req-42.a"


@pytest.mark.parametrize("sent", [None, "x" * 129, "two words", "new\nline"])
def test_a_missing_or_unsafe_id_is_replaced(served, sent):
    url, seen = served
    headers = {} if sent is None else {"X-Request-Id": sent.replace("\n", "%0A")}  # httpx refuses a raw newline
    r = httpx.get(url + "/probe", headers=headers)
    rid = r.headers["x-request-id"]
    assert rid != sent and len(rid) == 32 and seen == [rid]
    assert httpx.get(url + "/probe").headers["x-request-id"] != rid  # a fresh one per request


def test_completions_and_errors_carry_the_id(served):
    url, _ = served
    ok = httpx.post(url + "/v1/completions", headers={"X-Request-Id": "c-1"}, timeout=30,
                    json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "c-1"
    bad = httpx.post(url + "/v1/completions", headers={"X-Request-Id": "c-2"},
                     json={"model": "nope", "prompt": "Hi", "max_tokens": 2})
    assert bad.status_code == 404 and bad.headers["x-request-id"] == "c-2"
    with httpx.stream("POST", url + "/v1/completions", headers={"X-Request-Id": "c-3"}, timeout=30,
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True}) as s:
        assert s.headers["x-request-id"] == "c-3" and "data: [DONE]" in s.read().decode()


def test_json_lines_hold_the_request_id():
    record = logging.LogRecord("baton.front", logging.INFO, __file__, 1, "placed %s", ("r1",), None)
    token = current.set("abc")
    try:
        RequestIdFilter().filter(record)
    finally:
        current.reset(token)
    line = json.loads(JsonFormatter().format(record))
    assert line["request_id"] == "abc" and line["message"] == "placed r1" and line["logger"] == "baton.front"
    assert line["level"] == "INFO" and line["time"].endswith("Z")


def test_configure_logging_json_then_text(capsys):
    root = logging.getLogger()
    before = list(root.handlers), root.level
    try:
        configure_logging("json")
        stream = io.StringIO()
        (ours,) = [h for h in root.handlers if getattr(h, "_baton", False)]
        ours.setStream(stream)
        logging.getLogger("baton.x").info("hello")
        assert json.loads(stream.getvalue())["message"] == "hello"
        configure_logging("text")  # replaces ours, never stacks a second handler
        assert len([h for h in root.handlers if getattr(h, "_baton", False)]) == 1
        with pytest.raises(ValueError, match="text, json"):
            configure_logging("xml")
    finally:
        root.handlers[:] = before[0]
        root.setLevel(before[1])


def test_request_id_from():
    assert request_id_from(b"abc-1") == "abc-1"
    assert len(request_id_from(None)) == 32 and len(request_id_from(b"")) == 32

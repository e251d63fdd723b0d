"""The served /openapi.json documents the completion bodies and is a document tools accept."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis

BODIES = {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest"}


@pytest.fixture(scope="module")
def doc(backend) -> dict[str, Any]:
    r = httpx.get(backend.url + "/openapi.json")
    assert r.status_code == 200
    return r.json()


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref"] + [r for v in node.values() for r in refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in refs(v)]
    return []


def resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        node = node[part]
    return node


@pytest.mark.parametrize("path", BODIES)
def test_request_body_is_the_model(doc, path):
    op = doc["paths"][path]["post"]
    body = op["requestBody"]
    assert body["required"] is True
    assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{BODIES[path]}"}
    schema = resolve(doc, body["content"]["application/json"]["schema"]["$ref"])
    fields = set(schema["properties"])
    assert {"model", "max_tokens", "n", "stream", "stream_options", "response_format", "temperature"} <= fields
    assert schema["additionalProperties"] is False
    assert "$defs" not in schema
    assert ("messages" in fields) == (path == "/v1/chat/completions")
    assert ("prompt" in fields) == (path == "/v1/completions")
    assert {"messages" if "messages" in fields else "prompt"} == set(schema["required"])
    for status in ("400", "401", "404", "429", "503"):
        error = op["responses"][status]["content"]["application/json"]["schema"]
        assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "text/event-stream" in op["responses"]["200"]["content"]


def test_error_schema_is_openai_shaped(doc):
    info = resolve(doc, resolve(doc, "#/components/schemas/ErrorResponse")["properties"]["error"]["$ref"])
    assert set(info["properties"]) == {"message", "type", "param", "code"}


def test_every_ref_resolves(doc):
    found = refs(doc)
    assert "#/components/schemas/ResponseFormat" in found and "#/components/schemas/ChatMessage" in found
    for ref in found:
        assert isinstance(resolve(doc, ref), dict), ref


def test_schemathesis_accepts_the_document(backend, doc):
    assert doc["openapi"].startswith("3.1")
    schema = schemathesis.openapi.from_url(backend.url + "/openapi.json")
    schema.validate()  # raises on a document that is not valid OpenAPI
    ops = [result.ok() for result in schema.get_all_operations()]  # ok() raises on a broken operation
    assert {"POST /v1/chat/completions", "POST /v1/completions"} <= {op.label for op in ops}

"""Served model names: the model's own name by default, several aliases as vLLM's
``--served-model-name`` takes them, and a clear 404 for any other name."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from baton_serve.cluster.cli import build_parser
from baton_serve.cluster.config import ConfigError, load_config
from baton_serve.router.api import build_app
from baton_serve.router.server import ServerThread
from baton_serve.workers.checkpoint.default_model import served_name


def test_a_cached_conversion_is_served_under_the_models_own_name(tmp_path, monkeypatch):
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    converted = tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct-b179c9523d0e6a0f"
    converted.mkdir(parents=True)
    assert served_name(converted) == "SmolLM2-135M-Instruct"
    # a folder of the user's keeps its name, digest-like suffix or not
    mine = tmp_path / "mine" / "llama-b179c9523d0e6a0f"
    mine.mkdir(parents=True)
    assert served_name(mine) == "llama-b179c9523d0e6a0f"
    assert load_config(None).server.served_model_names(converted) == ["SmolLM2-135M-Instruct"]


def test_served_model_name_takes_several_names():
    args = build_parser().parse_args(["serve", "--served-model-name", "smol", "gpt-4o-mini"])
    assert args.served_model_name == ["smol", "gpt-4o-mini"]
    server = load_config(None).with_overrides(**{"server.model_name": args.served_model_name}).server
    assert server.served_model_names(Path("/x/y")) == ["smol", "gpt-4o-mini"]
    assert load_config(None).with_overrides(**{"server.model_name": "one"}).server.served_model_names(
        Path("/x/y")) == ["one"]


@pytest.mark.parametrize("names", [[], ["a", "a"], [""]])
def test_bad_served_names_are_refused(names):
    with pytest.raises(ConfigError, match="server.model_name"):
        load_config(None).with_overrides(**{"server.model_name": names})


def test_requests_may_use_any_alias(backend):
    app = build_app(backend.client, backend.tokenizer, ["smol", "smol-latest"], 512)
    server = ServerThread(app).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            models = http.get("/v1/models").json()["data"]
            assert [m["id"] for m in models] == ["smol", "smol-latest"]
            assert {m["root"] for m in models} == {"smol"}
            assert http.get("/v1/models/smol-latest").json()["id"] == "smol-latest"
            assert http.get("/v1/models/other").status_code == 404
            body = {"prompt": "Hello", "max_tokens": 2, "ignore_eos": True}
            for name in ("smol", "smol-latest"):
                r = http.post("/v1/completions", json={**body, "model": name})
                assert r.status_code == 200, r.text
                assert r.json()["model"] == "smol"  # the first name, as vLLM answers
            r = http.post("/v1/completions", json={**body, "model": "other"})
            assert r.status_code == 404
            assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    finally:
        server.stop()

"""Mask exactness on the default model's tokenizer (49152 logits): random JSON schemas x sampling
settings x random logits. Every sampled token is accepted, EOS comes only when the grammar accepts,
refused tokens are refused, and every finished output parses and validates against its schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from baton_serve.workers.sampling.structured import (
    LLGuidanceBackend,
    StructuredSpec,
    allocate_bitmask,
    apply_bitmask_,
    unpack_bitmask,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

MAX_TOKENS = 200
PROPERTY = settings(max_examples=50, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

names = st.text(alphabet="abcdefghij_", min_size=1, max_size=6)
enum_strings = st.lists(st.text(alphabet='abc xyz"\\é/-', min_size=0, max_size=5), min_size=1, max_size=4,
                        unique=True)


@st.composite
def integer_schemas(draw: st.DrawFn) -> dict[str, Any]:
    low = draw(st.integers(-1000, 1000))
    schema: dict[str, Any] = {"type": "integer"}
    if draw(st.booleans()):
        schema["minimum"] = low
    if draw(st.booleans()):
        schema["maximum"] = low + draw(st.integers(0, 5000))
    return schema


@st.composite
def number_schemas(draw: st.DrawFn) -> dict[str, Any]:
    low = draw(st.integers(-40, 40)) / 4
    return {"type": "number", "minimum": low, "maximum": low + draw(st.integers(0, 400)) / 4}


@st.composite
def string_schemas(draw: st.DrawFn) -> dict[str, Any]:
    longest = draw(st.integers(0, 10))
    schema: dict[str, Any] = {"type": "string", "maxLength": longest}
    if draw(st.booleans()):
        schema["minLength"] = draw(st.integers(0, longest))
    return schema


leaves = st.one_of(
    st.just({"type": "boolean"}), st.just({"type": "null"}), integer_schemas(), number_schemas(),
    string_schemas(), enum_strings.map(lambda e: {"enum": e}),
    enum_strings.map(lambda e: {"type": "string", "enum": e}),
)


@st.composite
def object_schemas(draw: st.DrawFn, children: st.SearchStrategy[dict[str, Any]],
                   min_size: int = 0) -> dict[str, Any]:
    props = draw(st.dictionaries(names, children, min_size=min_size, max_size=4))
    required = draw(st.sets(st.sampled_from(sorted(props)))) if props else set()
    # additionalProperties false: otherwise any key (an unbounded string) could follow.
    return {"type": "object", "properties": props, "required": sorted(required), "additionalProperties": False}


def array_schemas(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(lambda items, lo, extra: {"type": "array", "items": items, "minItems": lo,
                                               "maxItems": lo + extra},
                     children, st.integers(0, 2), st.integers(0, 2))


schemas = st.recursive(leaves, lambda kids: object_schemas(kids) | array_schemas(kids), max_leaves=8)
top_schemas = object_schemas(schemas, min_size=1) | schemas
sampling = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.7, 1.5]), "top_k": st.sampled_from([0, 1, 5, 50]),
    "top_p": st.sampled_from([1.0, 0.9, 0.5]), "seed": st.integers(0, 2**31 - 1),
})


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator) -> int:
    """Plain reference sampling of one row: greedy, or temperature + top-k + top-p + multinomial."""
    if temperature == 0:
        return int(torch.argmax(logits))
    x = logits / temperature
    if top_k:
        kth = torch.topk(x, min(top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1:
        probs, order = torch.sort(torch.softmax(x, -1), descending=True)
        drop = torch.cumsum(probs, -1) - probs > top_p  # keep up to and including the crossing token
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(torch.softmax(x, -1), 1, generator=gen))


@pytest.fixture(scope="module")
def model(default_model_dir: Path) -> tuple[LLGuidanceBackend, Tokenizer, int, int]:
    tok = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    config = json.loads((default_model_dir / "config.json").read_text())
    vocab, eos = int(config["vocab_size"]), int(config["eos_token_id"])
    return LLGuidanceBackend(tok.to_str(), vocab, [eos]), tok, vocab, eos


@PROPERTY
@given(schema=top_schemas, params=sampling)
def test_masked_sampling_yields_valid_json(model, schema: dict[str, Any], params: dict[str, Any]) -> None:
    backend, tok, vocab, eos = model
    assert vocab == 49152
    jsonschema.Draft202012Validator.check_schema(schema)
    m = backend.matcher(backend.compile(StructuredSpec.json_schema(schema)))
    gen = torch.Generator().manual_seed(params["seed"])
    bitmask = allocate_bitmask(1, vocab)
    tokens: list[int] = []
    finished = False
    for _ in range(MAX_TOKENS):
        m.fill_bitmask(bitmask, 0)
        ok = unpack_bitmask(bitmask, vocab)[0]
        assert bool(ok[eos]) == m.is_accepting()
        logits = torch.randn(1, vocab, generator=gen)
        apply_bitmask_(logits, bitmask, [0])
        assert torch.equal(torch.isfinite(logits[0]), ok)
        refused = torch.nonzero(~ok).reshape(-1)
        if len(refused):  # the mask is exact the other way too: a masked-out token is refused
            assert not m.accept(int(refused[torch.randint(len(refused), (1,), generator=gen)]))
        t = sample(logits[0], params["temperature"], params["top_k"], params["top_p"], gen)
        assert ok[t] and m.accept(t), (t, tok.decode(tokens))
        if t == eos:
            finished = True
            break
        tokens.append(t)
        if m.is_terminated():
            finished = True
            break
    text = tok.decode(tokens, skip_special_tokens=False)
    if finished:
        jsonschema.validate(json.loads(text), schema)
    else:  # only unbounded numbers can run this long under these schemas
        assert m.error() == "" and len(tokens) == MAX_TOKENS

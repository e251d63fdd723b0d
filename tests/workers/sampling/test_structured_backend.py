"""The llguidance backend on real tokenizers (the tiny test model's and the default model's): compile
cache and errors, EOS and padded ids in masks, regex and choice outputs, replay, rollback, copy."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from baton_serve.workers.errors import InvalidRequestError
from baton_serve.workers.sampling.structured import (
    GrammarMatcher,
    LLGuidanceBackend,
    StructuredSpec,
    allocate_bitmask,
    apply_bitmask_,
    make_backend,
    unpack_bitmask,
)
from tokenizers import Tokenizer

from tests.tiny_model import build_tokenizer

PAD = 64  # extra logits columns past the tokenizer, as padded embeddings give


@dataclass
class Setup:
    backend: LLGuidanceBackend
    tokenizer: Tokenizer
    eos: int
    words: int  # the tokenizer's own vocabulary size


@pytest.fixture(scope="module", params=["tiny", "default"])
def setup(request: pytest.FixtureRequest) -> Setup:
    if request.param == "tiny":
        tok = build_tokenizer(384)
    else:
        path: Path = request.getfixturevalue("default_model_dir")
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    words = tok.get_vocab_size()
    backend = make_backend("llguidance", tok.to_str(), words + PAD, [eos])
    assert isinstance(backend, LLGuidanceBackend)
    return Setup(backend, tok, eos, words)


def allowed(m: GrammarMatcher, vocab: int) -> torch.Tensor:
    bm = allocate_bitmask(1, vocab)
    m.fill_bitmask(bm, 0)
    return unpack_bitmask(bm, vocab)[0]


def run_random(s: Setup, spec: StructuredSpec, seed: int, limit: int = 120) -> tuple[list[int], bool]:
    """Sample from random logits under the mask until EOS / termination / limit: (tokens, finished)."""
    vocab = s.backend.vocab_size
    m = s.backend.matcher(s.backend.compile(spec))
    gen = torch.Generator().manual_seed(seed)
    bm = allocate_bitmask(1, vocab)
    out: list[int] = []
    for _ in range(limit):
        m.fill_bitmask(bm, 0)
        ok = unpack_bitmask(bm, vocab)[0]
        assert not ok[s.words:].any(), "a padded id was allowed"
        assert bool(ok[s.eos]) == m.is_accepting()
        logits = torch.randn(1, vocab, generator=gen) * 3
        apply_bitmask_(logits, bm, [0])
        t = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=gen))
        assert ok[t] and m.accept(t)
        if t == s.eos:
            return out, True
        out.append(t)
        if m.is_terminated():
            return out, True
    return out, False


# ---------------------------------------------------------------------- compile


def test_second_compile_is_a_cache_hit(setup: Setup) -> None:
    b = setup.backend
    spec = StructuredSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}})
    before = b.stats()
    first = b.compile(spec)
    again = b.compile(StructuredSpec.from_dict(spec.to_dict()))
    after = b.stats()
    assert again is first
    assert after["cache_hits"] == before["cache_hits"] + 1
    assert after["compiles"] == before["compiles"] + 1
    assert after["compile_seconds_last"] == first.compile_seconds > 0
    assert after["compile_seconds_total"] >= before["compile_seconds_total"] + first.compile_seconds


def test_cache_is_bounded_lru(setup: Setup) -> None:
    b = LLGuidanceBackend(setup.tokenizer.to_str(), setup.words, [setup.eos], cache_size=2)
    x, y, z = (StructuredSpec.regex(p) for p in ("x+", "y+", "z+"))
    cx = b.compile(x)
    b.compile(y)
    assert b.compile(x) is cx  # x is now the most recent
    b.compile(z)  # evicts y
    assert b.stats()["cached"] == 2
    assert b.compile(x) is cx
    hits = b.stats()["cache_hits"]
    b.compile(y)
    assert b.stats()["cache_hits"] == hits  # y was recompiled


def test_concurrent_compiles_all_work(setup: Setup) -> None:
    b = setup.backend
    specs = [StructuredSpec.regex(f"[a-c]{{{i}}}") for i in range(1, 9)] * 4
    results: list[object] = []
    errors: list[BaseException] = []

    def work(part: list[StructuredSpec]) -> None:
        try:
            results.extend(b.matcher(b.compile(s)) for s in part)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(specs[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == len(specs)


@pytest.mark.parametrize("spec, reason", [
    (StructuredSpec.json_schema({"type": "frobnicate"}), "Invalid type: frobnicate"),
    (StructuredSpec.json_schema({"type": "integer", "minimum": "x"}), "minimum"),
    (StructuredSpec.json_schema(False), "schema is false"),
    (StructuredSpec.regex("a(b"), "unclosed group"),
    (StructuredSpec.grammar("start: undefined_rule"), "unknown name"),
    (StructuredSpec.grammar("start: \"a\"\nstart: \"b\" ("), "cannot be compiled"),
])
def test_invalid_constraints_raise_with_the_reason(setup: Setup, spec: StructuredSpec, reason: str) -> None:
    hits = setup.backend.stats()["cached"]
    with pytest.raises(InvalidRequestError, match=re.escape(reason)) as info:
        setup.backend.compile(spec, param="response_format.json_schema")
    assert info.value.param == "response_format.json_schema"
    assert "<non-verbose/>" not in info.value.message
    assert setup.backend.stats()["cached"] == hits  # failures are not cached


@pytest.mark.parametrize("schema, feature", [
    ({"if": {"type": "string"}, "then": {"maxLength": 3}}, '"if", "then"'),
    ({"$ref": "https://example.com/schema.json"}, "https://example.com/schema.json"),
])
def test_unsupported_schema_features_are_named(setup: Setup, schema: dict, feature: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(feature)):
        setup.backend.compile(StructuredSpec.json_schema(schema))


def test_supported_schema_features_compile(setup: Setup) -> None:
    for schema in ({"type": "object", "patternProperties": {"^a": {"type": "integer"}}},
                   {"properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": {"x": {"type": "integer"}}},
                   {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, True):
        setup.backend.compile(StructuredSpec.json_schema(schema))


def test_tokenizer_wider_than_logits_is_refused(setup: Setup) -> None:
    with pytest.raises(ValueError, match="vocab"):
        LLGuidanceBackend(setup.tokenizer.to_str(), setup.words - 1, [setup.eos])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        LLGuidanceBackend(setup.tokenizer.to_str(), setup.words, [setup.words + 5])


# ---------------------------------------------------------------------- masks and outputs


def test_padded_ids_and_special_tokens_are_never_allowed(setup: Setup) -> None:
    b = setup.backend
    m = b.matcher(b.compile(StructuredSpec.json_object()))
    ok = allowed(m, b.vocab_size)
    assert ok.any() and not ok[setup.words:].any()
    assert not ok[setup.eos]  # "" is not a JSON object
    for pad in (setup.words, b.vocab_size - 1):
        assert not m.accept(pad)
    assert not m.accept(-1) and not m.accept(b.vocab_size + 10)


def test_eos_allowed_exactly_when_accepting(setup: Setup) -> None:
    b, tok = setup.backend, setup.tokenizer
    m = b.matcher(b.compile(StructuredSpec.regex("[0-9]+")))
    assert not allowed(m, b.vocab_size)[setup.eos] and not m.accept(setup.eos)
    assert m.accept_many(tok.encode("42").ids) == len(tok.encode("42").ids)
    assert m.is_accepting() and not m.is_terminated()
    assert allowed(m, b.vocab_size)[setup.eos]
    assert m.accept(setup.eos) and m.is_terminated()
    assert allowed(m, b.vocab_size).nonzero().reshape(-1).tolist() == [setup.eos]
    m.rollback(1)  # EOS taken before a stop is llguidance's token: undoing it reopens the number
    assert m.is_accepting() and not m.is_terminated() and m.accept_many(tok.encode("7").ids) == 1


@pytest.mark.parametrize("pattern", [r"[a-z]{1,6}@[a-z]{2,4}\.(com|org)", r"-?[0-9]{1,4}(\.[0-9]{1,2})?",
                                     r"(yes|no|maybe) [A-Z]{2}"])
def test_regex_outputs_fully_match(setup: Setup, pattern: str) -> None:
    finished = 0
    for seed in range(6):
        tokens, done = run_random(setup, StructuredSpec.regex(pattern), seed)
        text = setup.tokenizer.decode(tokens, skip_special_tokens=False)
        if done:
            finished += 1
            assert re.fullmatch(pattern, text), text
    assert finished == 6


def test_choice_outputs_are_exactly_one_choice(setup: Setup) -> None:
    choices = ['he said "hi"', "back\\slash", "new\nline", "ünï 🙂", "a.*b", "yes", "yesterday"]
    for seed in range(12):
        tokens, done = run_random(setup, StructuredSpec.choice(choices), seed)
        assert done and setup.tokenizer.decode(tokens, skip_special_tokens=False) in choices


def test_json_output_is_compact_single_line(setup: Setup) -> None:
    b, tok = setup.backend, setup.tokenizer
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array"}},
              "required": ["a", "b"], "additionalProperties": False}
    for text, ok in (('{"a": 1, "b": [1, "x"]}', True), ('{"a":1,"b":[]}', False),
                     ('{\n  "a": 1, "b": []}', False), ('{"b": [], "a": 1}', False)):
        m = b.matcher(b.compile(StructuredSpec.json_schema(schema)))
        ids = tok.encode(text).ids
        assert (m.accept_many(ids) == len(ids) and m.is_accepting()) is ok, text


# ---------------------------------------------------------------------- state


def test_refused_token_leaves_matcher_unchanged(setup: Setup) -> None:
    b, tok = setup.backend, setup.tokenizer
    m = b.matcher(b.compile(StructuredSpec.regex("abc")))
    before = allowed(m, b.vocab_size)
    assert not m.accept(tok.encode("z").ids[0])
    assert m.error() == "" and torch.equal(allowed(m, b.vocab_size), before)
    assert m.accept_many(tok.encode("abc").ids) == len(tok.encode("abc").ids) and m.is_terminated()


def test_accept_many_rebuilds_step_by_step_state(setup: Setup) -> None:
    b = setup.backend
    spec = StructuredSpec.json_schema({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "tags": {"type": "array", "items": {"enum": ["x", "yz"]}}},
        "required": ["name", "tags"], "additionalProperties": False})
    tokens, done = run_random(setup, spec, seed=3, limit=400)
    assert done
    stepper = b.matcher(b.compile(spec))
    masks = []
    for t in tokens:
        masks.append(allowed(stepper, b.vocab_size))
        assert stepper.accept(t)
    for k in (0, 1, len(tokens) // 2, len(tokens)):
        rebuilt = b.matcher(b.compile(spec))
        assert rebuilt.accept_many(tokens[:k]) == k
        assert torch.equal(allowed(rebuilt, b.vocab_size),
                           masks[k] if k < len(tokens) else allowed(stepper, b.vocab_size))
    # A refused token stops the replay there; EOS inside the list is replayed too.
    full = b.matcher(b.compile(spec))
    assert full.accept_many([*tokens, setup.eos, tokens[0]]) == len(tokens) + 1
    assert full.is_terminated() and full.num_tokens == len(tokens) + 1


def test_rollback_restores_earlier_masks(setup: Setup) -> None:
    b, tok = setup.backend, setup.tokenizer
    spec = StructuredSpec.json_schema({"type": "object", "properties": {"k": {"enum": ["alpha", "beta"]}},
                                       "required": ["k"], "additionalProperties": False})
    m = b.matcher(b.compile(spec))
    ids = tok.encode('{"k": "beta"}').ids
    masks = []
    for t in ids:
        masks.append(allowed(m, b.vocab_size))
        assert m.accept(t)
    end = allowed(m, b.vocab_size)
    assert m.is_terminated() and end.nonzero().reshape(-1).tolist() == [setup.eos]
    # EOS after the grammar stopped (llguidance does not record it) still counts as one token.
    assert m.accept(setup.eos) and m.accept(setup.eos) and m.num_tokens == len(ids) + 2
    m.rollback(2)
    assert m.is_terminated() and torch.equal(allowed(m, b.vocab_size), end)
    m.rollback(3)
    assert torch.equal(allowed(m, b.vocab_size), masks[len(ids) - 3])
    with pytest.raises(ValueError, match="cannot roll back"):
        m.rollback(len(ids))  # only len(ids) - 3 are left
    assert m.error() == "" and m.accept_many(ids[len(ids) - 3:]) == 3 and m.is_accepting()


def test_copy_is_independent(setup: Setup) -> None:
    b, tok = setup.backend, setup.tokenizer
    m = b.matcher(b.compile(StructuredSpec.choice(["cat", "dog"])))
    fork = m.copy()
    assert m.accept_many(tok.encode("cat").ids) == len(tok.encode("cat").ids)
    assert fork.num_tokens == 0 and not fork.is_accepting()
    assert fork.accept_many(tok.encode("dog").ids) == len(tok.encode("dog").ids) and fork.is_accepting()


def test_fill_bitmask_rejects_a_wrong_shape(setup: Setup) -> None:
    b = setup.backend
    m = b.matcher(b.compile(StructuredSpec.json_object()))
    with pytest.raises(ValueError, match="words"):
        m.fill_bitmask(allocate_bitmask(1, b.vocab_size + 64), 0)


def test_json_object_accepts_any_object(setup: Setup) -> None:
    b, tok = setup.backend, setup.tokenizer
    for text, ok in (('{"a": [1, {"b": null}], "c": "d"}', True), ("{}", True), ("[1]", False), ('"x"', False)):
        m = b.matcher(b.compile(StructuredSpec.json_object()))
        ids = tok.encode(text).ids
        assert (m.accept_many(ids) == len(ids) and m.is_accepting()) is ok, text
        if ok:
            json.loads(text)

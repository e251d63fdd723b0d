"""Structured output core, no tokenizer needed: specs, the backend registry, bitmask application."""

from __future__ import annotations

import msgpack
import pytest
import torch
from baton_serve.workers.errors import InvalidRequestError
from baton_serve.workers.sampling.structured import (
    GrammarBackend,
    StructuredSpec,
    allocate_bitmask,
    apply_bitmask_,
    backend_names,
    make_backend,
    register_backend,
    unpack_bitmask,
)
from hypothesis import given, settings
from hypothesis import strategies as st

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
specs = st.one_of(
    st.dictionaries(st.text(max_size=6), json_values, max_size=4).map(StructuredSpec.json_schema),
    st.booleans().map(StructuredSpec.json_schema),
    st.just(StructuredSpec.json_object()),
    st.text(min_size=1, max_size=20).map(StructuredSpec.regex),
    st.lists(st.text(max_size=10), min_size=1, max_size=5).map(StructuredSpec.choice),
    st.text(min_size=1, max_size=30).filter(str.strip).map(StructuredSpec.grammar),
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(specs)
def test_spec_round_trips_through_dict_and_msgpack(spec: StructuredSpec) -> None:
    wire = msgpack.unpackb(msgpack.packb(spec.to_dict()))
    back = StructuredSpec.from_dict(wire)
    assert back == spec and back.key == spec.key and hash(back) == hash(spec)


def test_json_schema_accepts_dict_or_text_and_keeps_property_order() -> None:
    a = StructuredSpec.json_schema({"type": "object", "properties": {"b": {}, "a": {}}})
    b = StructuredSpec.json_schema('{"type": "object",\n "properties": {"b": {}, "a": {}}}')
    assert a == b and a.value == '{"type":"object","properties":{"b":{},"a":{}}}'
    # Property order is generation order, so a reordered schema is another constraint.
    c = StructuredSpec.json_schema({"type": "object", "properties": {"a": {}, "b": {}}})
    assert c.key != a.key


def test_keys_differ_by_kind_and_value() -> None:
    keys = {StructuredSpec.regex("a").key, StructuredSpec.grammar("a").key, StructuredSpec.regex("b").key,
            StructuredSpec.choice(["a"]).key, StructuredSpec.json_object().key}
    assert len(keys) == 5
    assert StructuredSpec.regex("a").key == StructuredSpec.regex("a").key


@pytest.mark.parametrize("make, fragment", [
    (lambda p: StructuredSpec.choice([], param=p), "non-empty list"),
    (lambda p: StructuredSpec.choice(["a", 3], param=p), "choice 1 must be a string"),
    (lambda p: StructuredSpec.choice("ab", param=p), "non-empty list"),
    (lambda p: StructuredSpec.json_schema([1, 2], param=p), "object or a boolean"),
    (lambda p: StructuredSpec.json_schema("[1]", param=p), "object or a boolean"),
    (lambda p: StructuredSpec.json_schema("{not json", param=p), "not valid JSON"),
    (lambda p: StructuredSpec.json_schema({"a": {1, 2}}, param=p), "not plain JSON"),
    (lambda p: StructuredSpec.json_schema({"a": float("nan")}, param=p), "not plain JSON"),
    (lambda p: StructuredSpec.regex("", param=p), "non-empty string"),
    (lambda p: StructuredSpec.regex(None, param=p), "non-empty string"),
    (lambda p: StructuredSpec.grammar("  \n", param=p), "non-empty Lark"),
    (lambda p: StructuredSpec.choice(["\ud800"], param=p), "not valid Unicode"),
    (lambda p: StructuredSpec.from_dict({"kind": "xml", "value": "x"}, param=p), "unknown structured"),
    (lambda p: StructuredSpec.from_dict({"kind": "regex", "value": 5}, param=p), "needs a string"),
    (lambda p: StructuredSpec.from_dict({"kind": "choice", "value": "{"}, param=p), "JSON list"),
])
def test_bad_specs_raise_invalid_request_naming_the_param(make, fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match=fragment) as info:
        make("structured_outputs.choice")
    assert info.value.param == "structured_outputs.choice"


def test_default_param_is_response_format() -> None:
    with pytest.raises(InvalidRequestError) as info:
        StructuredSpec.json_schema(3)
    assert info.value.param == "response_format"


def test_direct_construction_must_be_well_formed() -> None:
    with pytest.raises(ValueError):
        StructuredSpec("json_object", "{}")
    with pytest.raises(ValueError):
        StructuredSpec("regex", None)


# ---------------------------------------------------------------------- registry


def test_registry_knows_llguidance_and_lists_names_for_unknown() -> None:
    assert "llguidance" in backend_names()
    with pytest.raises(ValueError, match="known: .*llguidance"):
        make_backend("outlines-ish", "{}", 10, [0])


def test_register_backend_rejects_empty_or_taken_names() -> None:
    class Nameless(GrammarBackend):
        pass

    class Taken(GrammarBackend):
        name = "llguidance"

    for cls in (Nameless, Taken):
        with pytest.raises(ValueError, match="empty or taken"):
            register_backend(cls)


# ---------------------------------------------------------------------- bitmasks


def naive_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for j, i in enumerate(rows):
        for t in range(logits.shape[1]):
            word = t // 32
            on = word < bitmask.shape[1] and (int(bitmask[j, word]) >> (t % 32)) & 1
            if not on:
                out[i, t] = float("-inf")
    return out


@settings(max_examples=60, deadline=None, derandomize=True)
@given(batch=st.integers(1, 5), vocab=st.integers(1, 100), data=st.data())
def test_apply_bitmask_matches_bit_by_bit_reference(batch: int, vocab: int, data: st.DataObject) -> None:
    rows = data.draw(st.lists(st.integers(0, batch - 1), unique=True, max_size=batch))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    logits = torch.randn(batch, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows) + 1, (vocab + 31) // 32), generator=gen,
                            dtype=torch.int32)
    expected = naive_apply(logits, bitmask, rows)
    apply_bitmask_(logits, bitmask, rows)
    assert torch.equal(logits, expected)


def test_apply_bitmask_leaves_unlisted_rows_untouched() -> None:
    logits = torch.randn(4, 70)
    before = logits.clone()
    bitmask = torch.zeros(2, 3, dtype=torch.int32)  # nothing allowed
    apply_bitmask_(logits, bitmask, [3, 1])
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    assert torch.isinf(logits[[1, 3]]).all()
    apply_bitmask_(logits, bitmask, [])  # no constrained rows: nothing happens
    assert torch.equal(logits[[0, 2]], before[[0, 2]])


def test_apply_bitmask_all_rows_in_order_and_sign_bit() -> None:
    logits = torch.zeros(2, 64)
    bitmask = torch.tensor([[-(2**31), 1], [0, -1]], dtype=torch.int32)  # -2**31: only bit 31 set
    apply_bitmask_(logits, bitmask, [0, 1])
    assert torch.isfinite(logits[0]).nonzero().reshape(-1).tolist() == [31, 32]
    assert torch.isfinite(logits[1]).nonzero().reshape(-1).tolist() == list(range(32, 64))


def test_bitmask_narrower_than_logits_masks_the_rest() -> None:
    logits = torch.zeros(1, 40)
    apply_bitmask_(logits, allocate_bitmask(1, 32), [0])
    assert torch.isfinite(logits[0]).nonzero().reshape(-1).tolist() == list(range(32))


def test_allocate_bitmask_shape_and_all_allowed() -> None:
    bm = allocate_bitmask(3, 49152 + 5)
    assert bm.shape == (3, 1537) and bm.dtype == torch.int32
    assert unpack_bitmask(bm, 49152 + 5).all()


def test_apply_bitmask_rejects_wrong_dtype_or_too_few_rows() -> None:
    with pytest.raises(ValueError):
        apply_bitmask_(torch.zeros(2, 8), torch.zeros(2, 1, dtype=torch.int64), [0])
    with pytest.raises(ValueError):
        apply_bitmask_(torch.zeros(2, 8), torch.zeros(1, 1, dtype=torch.int32), [0, 1])

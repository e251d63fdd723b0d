"""What a request's output must look like: one small, hashable value that travels with the request.

A ``StructuredSpec`` is validated when it is made (bad input raises ``InvalidRequestError`` naming
the API field), holds its constraint as canonical text so equal constraints compare and hash equal,
and crosses msgpack and Ray as the plain dict of ``to_dict``. Compiling it is a backend's job
(``workers.sampling.structured.backend``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, get_args

from baton_serve.workers.errors import InvalidRequestError

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = get_args(Kind)
DEFAULT_PARAM = "response_format"


def _canonical_json(value: Any) -> str:
    # Not sort_keys: the order of "properties" is the order the fields are generated in, so two
    # schemas that differ only in key order are different constraints.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _checked(text: str, what: str, param: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (JSON allows "\ud800"); msgpack could not carry it
        raise InvalidRequestError(f"the {what} is not valid Unicode", param=param) from None
    return text


@dataclass(frozen=True)
class StructuredSpec:
    """One output constraint. ``value`` by kind: json: the schema as compact JSON text; json_object:
    None; regex: the pattern; choice: a JSON list of the allowed strings; grammar: Lark text."""

    kind: Kind
    value: str | None

    def __post_init__(self) -> None:
        # The constructors below validate contents; this only stops a malformed direct construction.
        if self.kind not in KINDS or (self.value is None) != (self.kind == "json_object"):
            raise ValueError(f"malformed StructuredSpec({self.kind!r}, {self.value!r}); use its constructors")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | str, param: str = DEFAULT_PARAM) -> StructuredSpec:
        """Output is JSON valid under ``schema`` (a dict, a bool schema, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}", param=param) from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(
                f"a JSON schema must be an object or a boolean, not {type(schema).__name__}", param=param)
        try:
            text = _canonical_json(schema)
        except (TypeError, ValueError) as exc:  # a dict holding sets, NaN, objects...
            raise InvalidRequestError(f"the JSON schema is not plain JSON: {exc}", param=param) from None
        return cls("json", _checked(text, "JSON schema", param))

    @classmethod
    def json_object(cls) -> StructuredSpec:
        """Output is any JSON object (OpenAI's ``{"type": "json_object"}``)."""
        return cls("json_object", None)

    @classmethod
    def regex(cls, pattern: str, param: str = DEFAULT_PARAM) -> StructuredSpec:
        """The whole output matches ``pattern`` (Rust ``regex`` syntax, anchored at both ends)."""
        if not isinstance(pattern, str) or not pattern:
            raise InvalidRequestError("a regex constraint must be a non-empty string", param=param)
        return cls("regex", _checked(pattern, "regex", param))

    @classmethod
    def choice(cls, choices: list[str], param: str = DEFAULT_PARAM) -> StructuredSpec:
        """The whole output is exactly one of ``choices``."""
        if not isinstance(choices, (list, tuple)) or not choices:
            raise InvalidRequestError("a choice constraint must be a non-empty list of strings", param=param)
        for i, c in enumerate(choices):
            if not isinstance(c, str):
                raise InvalidRequestError(
                    f"choice {i} must be a string, not {type(c).__name__}", param=param)
        return cls("choice", _checked(_canonical_json(list(choices)), "choice list", param))

    @classmethod
    def grammar(cls, lark: str, param: str = DEFAULT_PARAM) -> StructuredSpec:
        """The output is a sentence of the Lark grammar ``lark`` (its ``start`` rule)."""
        if not isinstance(lark, str) or not lark.strip():
            raise InvalidRequestError("a grammar constraint must be non-empty Lark text", param=param)
        return cls("grammar", _checked(lark, "grammar", param))

    # ------------------------------------------------------------------ transport
    def to_dict(self) -> dict[str, Any]:
        """Plain dict for msgpack and Ray; ``from_dict`` inverts it."""
        return {"kind": self.kind, "value": self.value}

    @classmethod
    def from_dict(cls, data: dict[str, Any], param: str = DEFAULT_PARAM) -> StructuredSpec:
        """Rebuild (and re-validate) a spec from ``to_dict``'s output."""
        if not isinstance(data, dict) or data.get("kind") not in KINDS:
            kind = data.get("kind") if isinstance(data, dict) else data
            raise InvalidRequestError(
                f"unknown structured output kind {kind!r}; known: {', '.join(KINDS)}", param=param)
        kind, value = data["kind"], data.get("value")
        if kind == "json_object":
            return cls.json_object()
        if not isinstance(value, str):
            raise InvalidRequestError(f"a {kind} constraint needs a string value", param=param)
        if kind == "json":
            return cls.json_schema(value, param)
        if kind == "choice":
            try:
                choices = json.loads(value)
            except ValueError:
                raise InvalidRequestError("a choice value must be a JSON list", param=param) from None
            return cls.choice(choices, param)
        return cls.regex(value, param) if kind == "regex" else cls.grammar(value, param)

    @cached_property
    def key(self) -> str:
        """A short stable string naming this constraint (equal specs, equal keys), for caches."""
        digest = hashlib.sha256((self.value or "").encode()).hexdigest()
        return f"{self.kind}:{digest[:32]}"

"""One usage record per response: what a tenant is billed for and how long it waited."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

ENDPOINTS = ("chat", "completion")

_STR = ("request_id", "tenant", "model", "weights_fingerprint", "endpoint", "finish_reason")
_OPTIONAL_STR = ("key_id", "idempotency_key")
_COUNT = ("prompt_tokens", "cached_tokens", "completion_tokens")
_OPTIONAL_SECONDS = ("queue_time_s", "ttft_s", "e2e_s")


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """The usage of one response, keyed by its ``request_id`` (e.g. ``chatcmpl-...``).

    Frozen: a store queues the object itself, so a caller's later change must not reach the row."""

    request_id: str
    tenant: str
    key_id: str | None  # a short non-secret id of the API key, never the key
    model: str
    weights_fingerprint: str
    endpoint: str  # "chat" | "completion"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str  # stop, length, abort, tool_calls, error, rejected ...
    status: int  # the HTTP status the client saw
    created: float  # unix time of arrival
    queue_time_s: float | None
    ttft_s: float | None
    e2e_s: float | None
    idempotency_key: str | None = None

    def __post_init__(self) -> None:
        # Checked here, not in the store: a record that exists can be stored, so a bad one fails at
        # its caller instead of in a writer thread's batch.
        for name in _STR:
            _check(name, getattr(self, name), str, "a string")
        for name in _OPTIONAL_STR:
            value = getattr(self, name)
            if value is not None:
                _check(name, value, str, "a string or None")
        if not self.request_id:
            raise ValueError("UsageRecord.request_id must not be empty")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"UsageRecord.endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        for name in _COUNT:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"UsageRecord.{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.status, int) or isinstance(self.status, bool):
            raise ValueError(f"UsageRecord.status must be an int, got {self.status!r}")
        _check("created", self.created, (int, float), "a number")
        for name in _OPTIONAL_SECONDS:
            value = getattr(self, name)
            if value is not None:
                _check(name, value, (int, float), "a number or None")

    def to_row(self) -> tuple[Any, ...]:
        """The field values in ``COLUMNS`` order."""
        return tuple(getattr(self, name) for name in COLUMNS)

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> UsageRecord:
        """The record whose ``to_row()`` is ``row``."""
        return cls(*row)


COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(UsageRecord))


def _check(name: str, value: Any, types: type | tuple[type, ...], what: str) -> None:
    if not isinstance(value, types) or isinstance(value, bool):
        raise ValueError(f"UsageRecord.{name} must be {what}, got {value!r}")

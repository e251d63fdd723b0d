"""Typed exceptions the engine raises; the HTTP front maps them to OpenAI error JSON."""

from __future__ import annotations


class BatonError(Exception):
    """Base class for every error Baton raises on purpose."""


class InvalidRequestError(BatonError, ValueError):
    """A request or parameter is invalid; nothing was allocated for it.

    ``param`` names the offending field the way the OpenAI API spells it, so the
    HTTP front can answer 400 with ``{"error": {"param": ...}}``.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ContextLengthExceededError(InvalidRequestError):
    """Prompt (plus requested output) does not fit the model's context window."""


class OutOfBlocksError(BatonError, RuntimeError):
    """The KV cache cannot hold a request even when it runs alone."""


class ModelLoadError(BatonError, RuntimeError):
    """A model folder is missing files or has an unsupported configuration."""


class KVTransferError(BatonError, RuntimeError):
    """Shipping KV blocks between a prefill and a decode worker failed (peer gone, timeout,
    header mismatch); the caller frees the destination blocks and retries or recomputes."""


class KVCacheError(BatonError, RuntimeError):
    """The KV block manager was called inconsistently (unknown sequence, stale
    prefix hit, counts going backwards); the call changed nothing."""


class OverloadedError(BatonError, RuntimeError):
    """Too much work queued or no live worker: the HTTP front answers 429 with Retry-After."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class WorkerLostError(BatonError, RuntimeError):
    """A worker holding the request died and the request could not continue elsewhere (its
    migrations ran out, or no healthy worker was left): the HTTP front answers 503."""


class TensorParallelError(BatonError, RuntimeError):
    """A tensor-parallel replica lost a rank (died, timed out, or its group broke): the replica is
    down as a whole and its requests are recovered like any dead worker's."""

"""Per-request sampling and stopping parameters, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from baton_serve.workers.errors import InvalidRequestError

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """What to sample and when to stop, in the names vLLM and OpenAI users know.

    ``temperature == 0`` means greedy. ``top_k <= 0`` disables top-k. Frequency and
    presence penalties count generated tokens only (OpenAI semantics); the
    repetition penalty applies to prompt and generated tokens (vLLM / HF semantics).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    banned_token_ids: list[int] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # A grammar the output must follow: ``workers.sampling.structured.StructuredSpec.to_dict()``
    # (a plain dict, so it travels with the request to other workers).
    structured_outputs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"n must be an integer >= 1, got {self.n!r}")
        _check(
            self.temperature >= 0.0,
            "temperature",
            f"temperature must be >= 0 (0 means greedy), got {self.temperature}",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(isinstance(self.top_k, int), "top_k", f"top_k must be an integer, got {self.top_k!r}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            0.0 < self.typical_p <= 1.0, "typical_p", f"typical_p must be in (0, 1], got {self.typical_p}"
        )
        # Bounded, not just > 0: dividing logits by a tiny penalty overflows fp32 to inf, and the
        # NaNs that follow fail the sampling step of the whole batch. Past 100x nothing useful changes.
        _check(
            0.01 <= self.repetition_penalty <= 100.0,
            "repetition_penalty",
            f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= 20,
            "logprobs",
            f"logprobs must be in [0, 20], got {self.logprobs}",
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                _check(-100.0 <= bias <= 100.0, "logit_bias", f"logit_bias for {tok} must be in [-100, 100]")
        if self.allowed_token_ids is not None:
            _check(len(self.allowed_token_ids) > 0, "allowed_token_ids", "allowed_token_ids must not be empty")
        if self.structured_outputs is not None:
            from baton_serve.workers.sampling.structured.spec import StructuredSpec

            StructuredSpec.from_dict(self.structured_outputs, param="structured_outputs")  # raises with the reason

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0)."""
        return self.temperature < _GREEDY_EPS

    def validate_vocab(self, vocab_size: int) -> None:
        """Reject token ids outside the vocabulary (needs the model, so not in __post_init__)."""
        for name, ids in (
            ("logit_bias", list(self.logit_bias or {})),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("banned_token_ids", self.banned_token_ids or []),
            ("stop_token_ids", self.stop_token_ids),
        ):
            for tok in ids:
                _check(
                    isinstance(tok, int) and 0 <= tok < vocab_size,
                    name,
                    f"{name} holds token id {tok!r}, outside the vocabulary [0, {vocab_size})",
                )


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)

"""Request checks that need only the model's limits, so a front end can run them without an engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from baton_serve.workers.errors import ContextLengthExceededError, InvalidRequestError, OutOfBlocksError
from baton_serve.workers.sampling.params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit: vocabulary, context window, and the smallest worker's KV cache."""

    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError (with the OpenAI ``param`` name) when the request cannot run."""
        if len(prompt_token_ids) == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        bad = next((t for t in prompt_token_ids
                    if not (isinstance(t, int) and 0 <= t < self.vocab_size)), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad!r} is outside the vocabulary "
                                      f"[0, {self.vocab_size})", param="prompt")
        params.validate_vocab(self.vocab_size)
        n_prompt = len(prompt_token_ids)
        if n_prompt >= self.max_model_len:
            raise ContextLengthExceededError(
                f"the prompt has {n_prompt} tokens; this model's context length is {self.max_model_len}, "
                "which must also leave room for at least one output token", param="prompt")
        if params.max_tokens is not None and n_prompt + params.max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                f"max_tokens ({params.max_tokens}) plus the prompt ({n_prompt} tokens) exceeds the "
                f"context length {self.max_model_len}", param="max_tokens")
        needed = (n_prompt + 1 + self.block_size - 1) // self.block_size
        if needed > self.num_blocks:
            raise OutOfBlocksError(f"the prompt needs {needed} KV blocks; the cache holds {self.num_blocks}")

"""Baton's engine: model, paged KV cache, scheduler, sampler, and the offline API."""

from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy so that light imports (errors, sampling params) don't pull in the model stack.
    if name == "LLM":
        from baton_serve.workers.llm import LLM

        return LLM
    if name == "SamplingParams":
        from baton_serve.workers.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(name)

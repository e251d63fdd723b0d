"""Shared fixtures: thread limits, tiny random-weight models, the real default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer GQA Llama (4 q-heads, 2 kv-heads) with random weights and a BPE tokenizer."""
    from tests.tiny_model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converted once into the user cache)."""
    from workers.checkpoint.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def real_tok(default_model_dir: Path):
    """The default model's tokenizer (SmolLM2-135M-Instruct)."""
    from workers.text.tokenizer import Tokenizer

    return Tokenizer.from_folder(default_model_dir)


def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain transformers forward loop with its own KV cache: the parity reference."""
    ids = torch.tensor([prompt_ids])
    out = model(input_ids=ids, use_cache=True)
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        tok = int(out.logits[0, -1].argmax())
        tokens.append(tok)
        out = model(input_ids=torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens

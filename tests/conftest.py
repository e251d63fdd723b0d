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

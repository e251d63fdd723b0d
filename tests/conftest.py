"""Shared fixtures: thread limits, tiny random-weight models, the real default model."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch

# The checkout's top-level folders are installed as baton_serve.*; on sys.path ahead of site-packages
# (where `python -m pytest` and pytest's rootdir insertion put the checkout) kernels/ would shadow
# Hugging Face's `kernels`, which transformers imports. The checkout stays reachable, last, for tests.*.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT] + [str(ROOT)]

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The fixed kernel defaults, not what this machine measures (kernels.kernel_choice): a test's numbers
# must not depend on which layout won on the CPU that runs it. tests/kernels/test_kernel_choice.py
# runs the measurement itself.
os.environ.setdefault("BATON_KERNEL_TUNING", "0")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer GQA Llama (4 q-heads, 2 kv-heads) with random weights and a BPE tokenizer."""
    from tests.tiny_model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converted once into the user cache)."""
    from baton_serve.workers.checkpoint.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def real_tok(default_model_dir: Path):
    """The default model's tokenizer (SmolLM2-135M-Instruct)."""
    from baton_serve.workers.text.tokenizer import Tokenizer

    return Tokenizer.from_folder(default_model_dir)


def local_ray(num_cpus: int):
    """A one-node Ray session on loopback with ``num_cpus`` logical CPUs, shut down after."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=256 << 20, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def tp_ray_session():
    """Room for tensor-parallel replicas' placement groups (one CPU bundle per rank: 8 logical CPUs
    on however many cores)."""
    yield from local_ray(8)


# A module that starts Ray (or a `baton serve` that does) is marked `ray`, and a test of the real
# default model `slow`, so that `make test-quick` (`-m "not ray and not slow"`) stays a quick,
# Ray-free inner loop without every such test saying so.
_STARTS_RAY = re.compile(r"\bray\.init\(|importorskip\(\"ray\"\)|\bray_session\b|\bCluster\(|\bstart_fronts\(|"
                         r"cli\", \"serve\"|\"baton\"\), \"serve\"")  # ... or a `baton serve` process


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    starts_ray: dict[Path, bool] = {}
    for item in items:
        path = Path(str(item.path))
        if path not in starts_ray:
            starts_ray[path] = bool(_STARTS_RAY.search(path.read_text(encoding="utf-8")))
        fixtures = getattr(item, "fixturenames", ())
        if starts_ray[path] or "ray_session" in fixtures or "tp_ray_session" in fixtures:
            item.add_marker(pytest.mark.ray)
        if "default_model_dir" in fixtures:
            item.add_marker(pytest.mark.slow)

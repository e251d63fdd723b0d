"""Fault scenarios run real Ray actors: the cluster tests' Ray session, one per module."""

import pytest

from tests.cluster.conftest import ray_session  # noqa: F401
from tests.faults.scenario import undisturbed


@pytest.fixture(scope="session")
def reference(tiny_model_dir):
    """The scenarios' prompts and their undisturbed tokens."""
    return undisturbed(tiny_model_dir)

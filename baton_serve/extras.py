"""Optional dependencies: importing one that is missing names the extra that installs it."""

from __future__ import annotations

import importlib
from types import ModuleType

from baton_serve import DISTRIBUTION

# module -> the extra of pyproject.toml that brings it
EXTRA_OF = {"triton": "triton", "matplotlib": "bench"}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message says which extra installs it."""


def install_hint(module: str) -> str:
    """The pip command that installs ``module``'s extra."""
    return f"pip install '{DISTRIBUTION}[{EXTRA_OF[module]}]'"


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise MissingExtraError naming the extra it comes with."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(f"{purpose} needs {module!r}, which is not installed: "
                                f"{install_hint(module)}") from exc

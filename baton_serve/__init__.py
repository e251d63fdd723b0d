"""Baton: disaggregated prefill/decode LLM serving on Ray.

Everything installs under this one import name. The repository keeps its architecture's folders at
the top (``cluster/``, ``workers/``, ``router/``, ``kernels/``); the build maps each one in here
(``pyproject.toml``, ``[tool.setuptools.package-dir]``), so ``baton_serve.kernels`` is ours whatever
else a virtualenv holds (Hugging Face's ``kernels``, PyPI's ``baton``)."""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "baton-serve"

try:
    __version__ = metadata.version(DISTRIBUTION)
except metadata.PackageNotFoundError:  # a source tree run without installing
    __version__ = "0+unknown"

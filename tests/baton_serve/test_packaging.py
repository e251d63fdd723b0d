"""One import name: everything of ours installs under ``baton_serve``, beside whatever else a
virtualenv holds (Hugging Face's ``kernels``, which transformers >= 5.25 requires; PyPI's ``baton``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("cluster", "workers", "router", "kernels")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _run(code: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env=env)


def test_every_subpackage_is_mapped_and_listed():
    tool = _pyproject()["tool"]["setuptools"]
    assert tool["package-dir"] == {"baton_serve": "baton_serve", **{f"baton_serve.{f}": f for f in FOLDERS}}
    on_disk = {"baton_serve"} | {
        "baton_serve." + ".".join(init.parent.relative_to(ROOT).parts)
        for f in FOLDERS for init in (ROOT / f).rglob("__init__.py") if "__pycache__" not in init.parts}
    assert set(tool["packages"]) == on_disk, "add the new subpackage to [tool.setuptools] packages"


def test_no_source_imports_a_bare_top_level_name():
    # Under the checkout `import cluster` still resolves (the cwd is on sys.path), loading a second
    # copy of a module with its own registries; outside it, it fails. Either way it is a bug.
    offenders = []
    for folder in (*FOLDERS, "tests", "benchmarks", "baton_serve"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                              if n and n.split(".")[0] in FOLDERS]
    assert not offenders, offenders


def test_our_kernels_beside_hugging_faces(tmp_path: Path):
    out = _run("import json, baton_serve.kernels as k, baton_serve.cluster.cli as c, baton_serve;"
               "print(json.dumps([k.__file__, c.__file__, baton_serve.__version__]))", tmp_path)
    assert out.returncode == 0, out.stderr
    kernels_file, cli_file, version = __import__("json").loads(out.stdout)
    assert Path(kernels_file).resolve() == ROOT / "kernels" / "__init__.py"
    assert Path(cli_file).resolve() == ROOT / "cluster" / "cli.py"
    assert version == _pyproject()["project"]["version"]
    # the name Hugging Face uses is left to them: theirs (when installed) is what `import kernels` finds
    theirs = _run("import kernels; print(kernels.__file__)", tmp_path)
    if theirs.returncode == 0:
        assert Path(theirs.stdout.strip()).resolve().parent != ROOT / "kernels"
    else:
        assert "No module named 'kernels'" in theirs.stderr


def test_version_flag(tmp_path: Path):
    out = subprocess.run([str(Path(sys.executable).with_name("baton")), "--version"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"baton {_pyproject()['project']['version']}"


def test_serving_dependencies_are_core():
    project = _pyproject()["project"]
    core = {d.split(">")[0].split("=")[0].split(";")[0].strip().lower() for d in project["dependencies"]}
    assert {"ray", "fastapi", "uvicorn", "prometheus-client", "httpx", "torch"} <= core
    extras = project["optional-dependencies"]
    assert {"triton", "test", "bench"} <= set(extras) and not extras.get("serve")


def test_a_missing_extra_is_named(monkeypatch):
    from baton_serve.extras import MissingExtraError, require

    monkeypatch.setitem(sys.modules, "triton", None)  # what `import triton` gives where it is not installed
    with pytest.raises(MissingExtraError, match=r"pip install 'baton-serve\[triton\]'"):
        require("triton", "BATON_KERNEL_BACKEND=triton")

"""Baton's ``kernels`` package is the one every process imports, whatever its working directory:
Hugging Face ships a distribution with the same import name (transformers >= 5.25 requires it), and
where both are installed theirs wins in site-packages, breaking the workers and transformers alike."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

OURS = Path(__file__).resolve().parents[2] / "kernels"


def test_import_kernels_from_any_directory_finds_ours(tmp_path: Path):
    out = subprocess.run([sys.executable, "-c", "import kernels, sys; sys.stdout.write(kernels.__file__ or '')"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout).resolve().parent == OURS, (
        f"'import kernels' outside the checkout finds {out.stdout!r}: another distribution named 'kernels' "
        "is installed (pip show kernels); transformers >= 5.25 pulls in Hugging Face's")


def test_the_cli_refuses_a_shadowing_kernels_package(tmp_path: Path):
    fake = tmp_path / "kernels"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from cluster.cli import main; main(['--help'])"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "another distribution uses the name" in out.stderr and str(fake) in out.stderr


def test_the_cli_starts_with_ours(capsys):
    from cluster.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0 and "serve" in capsys.readouterr().out

"""The wheel as a user installs it (``pip install .``): one import name, the C kernel sources inside
it, and a ``baton serve`` from the installed copy, not the checkout, answers a chat completion."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.cluster.conftest import serving

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("cluster", "workers", "router", "kernels")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel built from a copy of the sources (building in the checkout would leave build/ and
    egg-info there), unpacked as pip installs it into a site folder of its own."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("baton_serve", *FOLDERS):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--disable-pip-version-check", "-q", "-w", str(tmp / "dist"), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp / "dist").glob("baton_serve-*.whl")
    zipfile.ZipFile(wheel).extractall(tmp / "site")
    return tmp / "site"


def _env(site: Path) -> dict[str, str]:
    # ahead of the virtualenv's editable install: this process and the Ray workers it starts import
    # the installed copy
    return {**os.environ, "PYTHONPATH": str(site), "RAY_AUTH_MODE": "disabled",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def test_the_wheel_holds_one_import_name_and_the_c_sources(installed: Path):
    dist_info = [p.name for p in installed.iterdir() if p.name.endswith(".dist-info")]
    assert {p.name for p in installed.iterdir()} - set(dist_info) == {"baton_serve"}
    c_sources = {p.name for p in (ROOT / "kernels" / "cpu").iterdir() if p.suffix in (".c", ".h")}
    assert {p.name for p in (installed / "baton_serve" / "kernels" / "cpu").iterdir()} == c_sources
    entry = (installed / dist_info[0] / "entry_points.txt").read_text()
    assert "baton = baton_serve.cluster.cli:main" in entry


def test_the_installed_copy_serves_a_chat_completion(installed: Path, tiny_model_dir: Path, tmp_path: Path):
    probe = subprocess.run([sys.executable, "-c", "import baton_serve.workers.llm as w; print(w.__file__)"],
                           cwd=tmp_path, env=_env(installed), capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert Path(probe.stdout.strip()).resolve().is_relative_to(installed)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton_serve.cluster.cli", "serve", "--model", str(tiny_model_dir),
         "--dtype", "float32", "--port", str(port), "--prefill", "1", "--decode", "1"],
        cwd=tmp_path, env=_env(installed), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with serving(proc) as lines:
        assert any("ready in" in line for line in lines), "".join(lines)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while httpx.get(base + "/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        (model,) = [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]]
        assert model == tiny_model_dir.name
        reply = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["finish_reason"] in ("length", "stop")

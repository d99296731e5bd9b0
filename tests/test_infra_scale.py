"""The scale-out files in infra/scale/ cannot run here (no docker engine, no Kubernetes cluster): they are parsed and
checked for what this project promises: loopback-only published ports, no secret in the files, the same work-pool
and tracking wiring as the local stack, pinned torch, image versions matching the installed packages."""

import re

import mlflow
import yaml

from tasks.common.paths import PROJECT_ROOT

SCALE = PROJECT_ROOT / "infra" / "scale"


def test_compose_stack_publishes_only_on_loopback_and_wires_the_worker():
    doc = yaml.safe_load((SCALE / "docker-compose.yaml").read_text())
    services = doc["services"]
    assert {"postgres", "prefect-server", "mlflow", "worker"} <= set(services)
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)
    env = services["worker"]["environment"]
    assert env["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert env["OPD_WORK_POOL"] in services["worker"]["command"]
    assert services["mlflow"]["image"].endswith(f"v{mlflow.__version__}")
    assert services["prefect-server"]["image"].startswith("prefecthq/prefect:3")


def test_no_secret_is_written_in_the_files():
    text = (SCALE / "docker-compose.yaml").read_text()
    assert "${OPD_PG_PASSWORD" in text
    assert not re.search(r"PASSWORD:\s*[A-Za-z0-9]", text), "a literal password"
    assert not re.search(r"postgres(ql)?(\+asyncpg)?://opd:[^$]", text), "a literal password in a URL"


def test_image_pins_torch_before_the_project():
    lines = (SCALE / "Dockerfile").read_text().splitlines()
    torch = next(i for i, line in enumerate(lines) if "torch==" in line)
    project = next(i for i, line in enumerate(lines) if 'pip install' in line and '-e ".[ray]"' in line)
    assert torch < project


def test_ray_cluster_manifest_is_a_kuberay_cluster_for_the_project_image():
    doc = yaml.safe_load((SCALE / "ray-cluster.yaml").read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayCluster")
    head = doc["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    images = {c["image"] for c in head["template"]["spec"]["containers"]}
    for group in doc["spec"]["workerGroupSpecs"]:
        images |= {c["image"] for c in group["template"]["spec"]["containers"]}
    assert images == {"opd-merge:latest"}

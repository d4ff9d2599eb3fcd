"""The Redis Cluster options of the deployment files: the compose profile ``redis-cluster``
(``deploy/compose.redis-cluster.yml``, added to docker-compose.yml) and ``deploy/k8s/redis-cluster/``.

Validated as the other deployment files are (:mod:`tests.deploy.test_compose_and_k8s`): ``docker compose config -q``
on the two compose files with the profile on (skipped, with the reason, without a compose client), every
Kubernetes document against the Kubernetes OpenAPI schemas in strict mode, and the wiring a typo would break only
at run time: 6 nodes in cluster mode announcing stable names, one replica per primary in the create command, the
API pointed at a node with replica acknowledgement, MPFLOW_* names that are real settings.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy import test_compose_and_k8s as deploy

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_COMPOSE = ROOT / "deploy" / "compose.redis-cluster.yml"
CLUSTER_K8S = ROOT / "deploy" / "k8s" / "redis-cluster"
PROFILE = "redis-cluster"
NODES = [f"redis-node-{i}" for i in range(1, 7)]

K8S_DOCS = [
    (f"{path.name}#{i}", doc)
    for path in sorted(CLUSTER_K8S.glob("*.y*ml"))
    for i, doc in enumerate(yaml.safe_load_all(path.read_text()))
    if doc is not None
]


def _k8s(kind: str) -> dict[str, Any]:
    found = [doc for _, doc in K8S_DOCS if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} under {CLUSTER_K8S}, found {len(found)}"
    return found[0]


def test_compose_profile_config_is_valid() -> None:
    command, reason = deploy._compose_command()
    if command is None:
        pytest.skip(f"docker compose config -q not run: {reason}")
    files = ["-f", str(deploy.COMPOSE), "-f", str(CLUSTER_COMPOSE)]
    done = subprocess.run(
        [*command, *files, "--profile", PROFILE, "config", "-q"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_compose_profile_is_wired() -> None:
    compose = yaml.safe_load(CLUSTER_COMPOSE.read_text())
    services = compose["services"]
    for name in NODES:
        node = services[name]
        assert node["profiles"] == [PROFILE] and node["image"].startswith("redis:7")
        script = node["command"][-1]
        assert "--cluster-enabled yes" in script and "--appendonly yes" in script
        assert "--cluster-announce-hostname" in script and node["environment"]["NODE_NAME"] == name
        volume = node["volumes"][0].split(":")[0]
        assert volume in compose["volumes"]
    init = services["redis-cluster-init"]
    assert init["profiles"] == [PROFILE] and set(init["depends_on"]) == set(NODES)
    script = init["command"][-1]
    assert "--cluster-replicas 1" in script and "for i in 1 2 3 4 5 6" in script
    api = services["api"]
    assert api["depends_on"]["redis-cluster-init"]["condition"] == "service_completed_successfully"
    host = re.match(r"redis://([^:/]+):6379", api["environment"]["MPFLOW_REDIS_URL"]).group(1)
    assert host in NODES
    assert "MPFLOW_REDIS_WAIT_REPLICAS" in api["environment"]
    assert set(api["environment"]) <= deploy.SETTINGS_ENV | deploy.CLI_ENV, "an MPFLOW_* name no setting reads"


@pytest.mark.parametrize("version", deploy.K8S_VERSIONS)
@pytest.mark.parametrize(("where", "doc"), K8S_DOCS, ids=[w for w, _ in K8S_DOCS])
def test_k8s_cluster_manifest_matches_the_kubernetes_schema(deploy_kv, where: str, doc: dict, version: str) -> None:
    kv = deploy_kv
    try:
        kv.validate(doc, version, strict=True)
    except kv.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{where} ({doc['kind']}) against Kubernetes {version}: {path}: {exc.message}")


@pytest.fixture
def deploy_kv():
    if deploy.kubernetes_validate is None:
        pytest.skip("kubernetes-validate is not installed: pip install -e '.[dev]'")
    return deploy.kubernetes_validate


def test_k8s_cluster_objects_refer_to_each_other() -> None:
    service, sts, job = _k8s("Service"), _k8s("StatefulSet"), _k8s("Job")
    name = sts["metadata"]["name"]
    assert sts["spec"]["serviceName"] == service["metadata"]["name"] == name
    assert service["spec"]["clusterIP"] == "None"
    assert sts["spec"]["replicas"] == 6
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert all(labels[k] == v for k, v in service["spec"]["selector"].items())
    container = sts["spec"]["template"]["spec"]["containers"][0]
    script = container["args"][-1]
    assert "--cluster-enabled yes" in script and f'"$POD_NAME.{name}"' in script
    assert {p["containerPort"] for p in container["ports"]} == {6379, 16379}
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == container["volumeMounts"][0]["name"]
    init = job["spec"]["template"]["spec"]["containers"][0]["args"][-1]
    assert "--cluster-replicas 1" in init and "for i in 0 1 2 3 4 5" in init and f"{name}-$i.{name}" in init
    # the URL the header tells to put in mpflow-settings names a real pod of the StatefulSet
    header = (CLUSTER_K8S / "redis-cluster.yaml").read_text()
    assert f"MPFLOW_REDIS_URL: redis://{name}-0.{name}:6379/0" in header

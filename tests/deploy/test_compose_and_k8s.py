"""The deployment files: docker-compose.yml, deploy/k8s, the Dockerfiles, Prometheus and Grafana config.

* ``docker compose config -q`` validates the compose file against the Compose specification — it needs only
  the docker client with its compose plugin, or the standalone ``docker-compose`` (no engine); skipped with the
  reason where neither is present.
* Every YAML document under ``deploy/k8s`` is validated against the Kubernetes OpenAPI schemas in *strict*
  mode (unknown fields rejected) with ``kubernetes-validate``, whose wheel ships the JSON schemas (no network),
  for the oldest Kubernetes version we support and the newest the package knows.
* The wiring between the files is checked where a typo would only show at run time: MPFLOW_* names are real
  settings, probes hit /readyz and /healthz, selectors match, the Grafana panels query metrics that
  :mod:`mpflow.service.api.metrics` defines, Prometheus scrapes the compose ``api`` service, COPY sources reach the
  build.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from mpflow.service.api.metrics import Metrics
from mpflow.service.settings import Settings

try:  # a dev dependency (pyproject.toml): its wheel carries the Kubernetes JSON schemas
    from kubernetes_validate import utils as kubernetes_validate
except ImportError:  # pragma: no cover - the k8s tests skip, saying why
    kubernetes_validate = None

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = ROOT / "docker-compose.yml"
# HPA autoscaling/v2, PDB policy/v1 and Job ttlSecondsAfterFinished are GA since 1.23-1.25
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version() if kubernetes_validate else "latest")
# read by service/cli.py (not Settings): bind address, port, worker processes
CLI_ENV = {"MPFLOW_HOST", "MPFLOW_PORT", "MPFLOW_WORKERS"}
SETTINGS_ENV = {f"MPFLOW_{name.upper()}" for name in Settings.model_fields}


def _k8s_documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.y*ml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                docs.append((f"{path.name}#{i}", doc))
    return docs


K8S_DOCS = _k8s_documents()


def _by_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in K8S_DOCS if doc["kind"] == kind]


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in _by_kind(kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''} under deploy/k8s, found {len(found)}"
    return found[0]


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture
def kv():
    """``kubernetes_validate.utils``, or a skip that says how to install it."""
    if kubernetes_validate is None:
        pytest.skip("kubernetes-validate is not installed: pip install -e '.[dev]'")
    return kubernetes_validate


# ---- docker compose ------------------------------------------------------------------------------------------


def _compose_command() -> tuple[list[str] | None, str]:
    """The compose CLI to validate with → (argv prefix, or None with the reason none can run).

    ``docker compose`` (the v2 plugin) where the docker client has it, else the standalone ``docker-compose``
    (Debian's 1.29, which checks the same services/volumes schema; the file therefore avoids v2-only top-level
    keys such as ``name``)."""
    docker = shutil.which("docker")
    said = "no docker client on PATH"
    if docker is not None:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            return [docker, "compose"], ""
        said = (probe.stderr.strip() or probe.stdout.strip() or f"exit {probe.returncode}").splitlines()[0][:120]
        said = f"the docker client has no compose plugin (`docker compose version`: {said})"
    standalone = shutil.which("docker-compose")
    if standalone is not None:
        return [standalone], ""
    return None, f"{said}, and no standalone docker-compose on PATH"


def test_docker_compose_config_is_valid() -> None:
    command, reason = _compose_command()
    if command is None:
        pytest.skip(f"docker compose config -q not run: {reason}")
    done = subprocess.run(
        [*command, "-f", str(COMPOSE), "config", "-q"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_compose_stack_is_wired() -> None:
    compose = _compose()
    services = compose["services"]
    assert {"api", "lb", "redis", "prometheus", "grafana"} <= set(services)
    api, lb, redis = services["api"], services["lb"], services["redis"]
    # the API: built from deploy/Dockerfile, 2 replicas, not published itself (the balancer is)
    assert (ROOT / api["build"]["context"] / api["build"]["dockerfile"]).is_file()
    assert api["deploy"]["replicas"] == 2
    assert "ports" not in api and "8000" in [str(p) for p in api["expose"]]
    assert api["environment"]["MPFLOW_REDIS_URL"] == "redis://redis:6379/0"
    assert "/healthz" in " ".join(api["healthcheck"]["test"])
    assert set(api["environment"]) <= SETTINGS_ENV | CLI_ENV, "an MPFLOW_* name that no setting reads"
    # one published port, 8000, proxied to the api service
    assert lb["ports"] == ["8000:8000"]
    assert lb["depends_on"]["api"]["condition"] == "service_healthy"
    nginx = (ROOT / lb["volumes"][0].split(":")[0]).read_text()
    assert "listen 8000;" in nginx and "http://api:8000" in nginx and "Upgrade" in nginx
    # Redis: AOF fsynced every second, data in a named volume
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "everysec"
    volume, target = redis["volumes"][0].split(":")[:2]
    assert target == "/data" and volume in compose["volumes"]
    # every bind mount's source exists
    for name, service in services.items():
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name}: mounts {source}, which does not exist"


def test_prometheus_scrapes_every_api_replica() -> None:
    compose = _compose()
    mount = next(v for v in compose["services"]["prometheus"]["volumes"] if v.endswith("prometheus.yml:ro"))
    config = yaml.safe_load((ROOT / mount.split(":")[0]).read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    job = jobs["mpflow-api"]
    assert job["metrics_path"] == "/metrics"
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["api"] and sd["type"] == "A"
    assert str(sd["port"]) in [str(p) for p in compose["services"]["api"]["expose"]]


# ---- Grafana -------------------------------------------------------------------------------------------------


def _defined_series() -> set[str]:
    """The sample names service/api/metrics.py exposes (a counter ``x`` exposes ``x_total``; a histogram
    ``x_bucket``, ``x_sum``, ``x_count``)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    series = set()
    for family in Metrics().registry.collect():
        series.update(family.name + s for s in suffixes[family.type])
    return series


def test_grafana_dashboard_queries_real_metrics() -> None:
    compose = _compose()
    grafana = compose["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"] if v.startswith("."))
    provisioning = ROOT / next(src for src, dst in mounts.items() if dst == "/etc/grafana/provisioning")
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    provider = yaml.safe_load((provisioning / "dashboards" / "mpflow.yml").read_text())["providers"][0]
    dashboards_dir = next(src for src, dst in mounts.items() if dst == provider["options"]["path"])
    dashboard = json.loads((ROOT / dashboards_dir / "mpflow.json").read_text())
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"].startswith(provider["options"]["path"])
    assert datasources[0]["url"] == "http://prometheus:9090"

    defined = _defined_series()
    exprs: list[str] = []
    for panel in dashboard["panels"]:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == datasources[0]["uid"]
            names = set(re.findall(r"\bmpflow_[a-z_]+", target["expr"]))
            assert names, f"panel {panel['title']!r}: {target['expr']!r} queries no mpflow metric"
            assert names <= defined, f"panel {panel['title']!r} queries undefined series {names - defined}"
            exprs.append(target["expr"])
    text = "\n".join(exprs)
    # the issue's panels: update rate, p50/p99 latency, batch size, streams, store errors
    assert "rate(mpflow_updates_total" in text
    for q in ("0.5", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(mpflow_http_request_duration_seconds_bucket" in text
    assert "mpflow_batch_size_" in text and "mpflow_streams" in text and "mpflow_store_errors_total" in text


# ---- Dockerfiles ---------------------------------------------------------------------------------------------


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, args = line.partition(" ")
            out.append((op.upper(), args.strip()))
    return out


def _dockerignored(path: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()]
    patterns = [p for p in patterns if p and not p.startswith("#")]
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path.split("/")[0], p) for p in patterns)


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_builds_from_the_repository(name: str) -> None:
    steps = _instructions(DEPLOY / name)
    stages = [args.split()[-1] for op, args in steps if op == "FROM"]
    assert stages == ["build", "runtime"], "multi-stage: a build stage and a runtime stage"
    copies = [args for op, args in steps if op == "COPY"]
    for args in copies:
        if args.startswith("--from="):
            continue
        for source in shlex.split(args)[:-1]:
            assert (ROOT / source).exists(), f"{name}: COPY {source}: no such path"
            assert not _dockerignored(source), f"{name}: COPY {source}, but .dockerignore excludes it"
    runs = [args for op, args in steps if op == "RUN"]
    torch_at = next(i for i, r in enumerate(runs) if "torch==2.13.0" in r)
    package_at = next(i for i, r in enumerate(runs) if 'pip install ".[full]"' in r)
    assert torch_at < package_at, 'torch must be pinned before `pip install ".[full]"` pulls an unpinned one'

    if name == "Dockerfile":
        assert "--index-url https://download.pytorch.org/whl/cpu" in runs[torch_at]
        assert "python:3.11-slim" in dict(steps)["ARG"]
    else:
        assert "nvidia/cuda:" in dict(steps)["ARG"] and "-runtime-" in dict(steps)["ARG"]
    runtime = steps[[i for i, (op, _) in enumerate(steps) if op == "FROM"][1] :]
    user = [args for op, args in runtime if op == "USER"]
    assert user and user[-1].split(":")[0] not in ("root", "0"), "the runtime stage runs as a non-root user"
    health = " ".join(args for op, args in runtime if op == "HEALTHCHECK")
    assert "/healthz" in health and "python" in health
    env = " ".join(args for op, args in runtime if op == "ENV")
    assert "MPFLOW_DATA_DIR=/data" in env and "MPFLOW_HOST=0.0.0.0" in env
    assert ("VOLUME", '["/data"]') in runtime


# ---- Kubernetes ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(("where", "doc"), K8S_DOCS, ids=[w for w, _ in K8S_DOCS])
def test_k8s_manifest_matches_the_kubernetes_schema(kv, where: str, doc: dict[str, Any], version: str) -> None:
    try:
        kv.validate(doc, version, strict=True)
    except kv.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{where} ({doc['kind']}) against Kubernetes {version}: {path}: {exc.message}")
    except kv.SchemaNotFoundError as exc:
        pytest.fail(f"{where}: {exc.message}")


def test_strict_validation_rejects_an_unknown_field(kv) -> None:
    """The validator can fail: a misspelt probe field and a string port are rejected."""
    deployment = copy.deepcopy(_one("Deployment", "mpflow-api"))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["httpGett"] = container["readinessProbe"].pop("httpGet")
    with pytest.raises(kv.ValidationError, match="httpGett"):
        kv.validate(deployment, K8S_VERSIONS[-1], strict=True)
    deployment = copy.deepcopy(_one("Deployment", "mpflow-api"))
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8000"
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_k8s_objects_refer_to_each_other() -> None:
    deployment = _one("Deployment", "mpflow-api")
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (container,) = pod["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    port = container["ports"][0]
    assert container["args"][container["args"].index("--port") + 1] == str(port["containerPort"])

    refs = {next(iter(ref)): ref[next(iter(ref))]["name"] for ref in container["envFrom"]}
    config_map, secret = _one("ConfigMap", refs["configMapRef"]), _one("Secret", refs["secretRef"])
    keys = set(config_map["data"]) | set(secret["stringData"])
    assert keys <= SETTINGS_ENV, f"names no setting reads: {keys - SETTINGS_ENV}"
    assert "MPFLOW_API_KEYS" in secret["stringData"] and "MPFLOW_API_KEYS" not in config_map["data"]

    service = _one("Service", "mpflow-api")
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] in (port["name"], port["containerPort"])
    hpa = _one("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "mpflow-api"}
    assert hpa["spec"]["minReplicas"] >= 2

    # Redis: the StatefulSet behind the URL of the ConfigMap, AOF everysec on a persistent volume
    redis = _one("StatefulSet", "mpflow-redis")
    host = re.match(r"redis://([^:/]+)", config_map["data"]["MPFLOW_REDIS_URL"]).group(1)
    assert host == redis["spec"]["serviceName"] and _one("Service", host)["spec"]["clusterIP"] == "None"
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes" and args[args.index("--appendfsync") + 1] == "everysec"
    claim = redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    mounts = redis["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": claim, "mountPath": "/data"} in mounts


def test_training_job_runs_torchrun_on_a_gpu() -> None:
    job = _one("Job", "mpflow-train")
    spec = job["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["command"] == ["torchrun"]
    args = container["args"]
    assert args[args.index("-m") + 1 : args.index("-m") + 3] == ["mpflow", "train"]
    nproc = int(next(a for a in args if a.startswith("--nproc_per_node=")).split("=")[1])
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert nproc == gpus >= 1, "one torchrun process per GPU requested"
    assert "--device=cuda" in args
    out = next(a for a in args if a.startswith("--out=")).split("=")[1]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == out)
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    _one("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    # the train options exist on the CLI (argparse would reject the Job's pod otherwise)
    help_text = subprocess.run(
        [sys.executable, "-m", "mpflow", "train", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert help_text.returncode == 0, help_text.stderr
    for arg in args[args.index("train") + 1 :]:
        assert arg.split("=")[0] in help_text.stdout, f"mpflow train has no option {arg.split('=')[0]}"

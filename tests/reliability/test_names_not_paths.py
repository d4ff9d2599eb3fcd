"""Names, not paths (issue 34 item 5), against the server as a user runs it (``python -m mpflow serve``, real Redis,
API keys on): a sampler prior's ``name`` and a stream's ``operator`` are looked up among the registry's folders
only. A path — absolute, ``..``, ``~``, a leading ``.``, a backslash — is 422 with a body that is byte-for-byte the
same whether or not the path exists, and nothing is loaded from it: here the existing paths are *valid* sampler
and operator folders (which the old resolver loaded, answering 201), next to a registered sampler that does load.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from mpflow.operators.registry import PRETRAINED_DIR

from tests.harness.server import ROOT, drop_prefix, serve_as_user
from tests.integration import conftest as integration

redis_url = integration.redis_url  # the real-Redis fixture of the integration tests

KEY = "kn-" + uuid.uuid4().hex
MODEL = {"family": "linear_gaussian", "params": {}}
MIXTURE = {"type": "mixture", "weights": [0.5, 0.5], "means": [[-2, 0], [2, 0]], "covs": [[[1, 0], [0, 1]]] * 2}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A registered sampler (under the server's operator dirs) and, outside every registry folder, a valid sampler
    folder and a copy of a shipped operator."""
    from mpflow.training.fit_sampler import fit_sampler

    root = tmp_path_factory.mktemp("names")
    registered = fit_sampler(MIXTURE, out=root / "registry", iterations=20, particles=16, seed=0, progress=False)
    outside = root / "outside"
    shutil.copytree(registered.path, outside / "samplers" / registered.name)
    operator = next(p for p in sorted(PRETRAINED_DIR.iterdir()) if p.name.startswith("linear_gaussian-d2-"))
    shutil.copytree(operator, outside / operator.name)
    return {
        "registry": root / "registry",
        "sampler_name": Path(registered.name),
        "sampler": outside / "samplers" / registered.name,
        "operator": outside / operator.name,
    }


@pytest.fixture(scope="module")
def server(redis_url, folders, tmp_path_factory) -> Iterator[str]:
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    env = {
        "MPFLOW_API_KEYS": f"tenant:{KEY}",
        "MPFLOW_REDIS_URL": redis_url,
        "MPFLOW_REDIS_PREFIX": prefix,
        "MPFLOW_OPERATOR_DIRS": str(folders["registry"]),
        "MPFLOW_LOG_LEVEL": "WARNING",
    }
    try:
        with serve_as_user(env, tmp_path_factory.mktemp("names-log") / "service.log") as s:
            yield s.url
    finally:
        asyncio.run(drop_prefix(redis_url, prefix))


def _paths(existing: Path) -> list[str]:
    """Path forms of an existing folder: absolute, relative to the server's directory through ``..``, and with a
    ``~`` or ``./`` spelling where they reach it."""
    forms = [str(existing), os.path.relpath(existing, ROOT)]
    home = Path.home()
    if existing.is_relative_to(home):
        forms.append("~/" + str(existing.relative_to(home)))
    return forms


def _missing(existing: Path) -> list[str]:
    return _paths(existing.with_name(existing.name + "-missing"))


OTHER_PATHS = ["/etc", "/tmp/x", "../x", "..", ".", "~", ".hidden", "./gpvi-d2-v1", "a\\b", "/nonexistent-9f1c/x"]


def _create(c: httpx.Client, **fields) -> httpx.Response:
    return c.post("/v1/streams", json={"model": MODEL, "method": "smc", "num_particles": 32, "seed": 1, **fields})


def test_a_sampler_is_named_from_the_registry_only(server, folders):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        ok = _create(c, prior={"type": "sampler", "name": str(folders["sampler_name"])})
        assert ok.status_code == 201, ok.text  # the registered name loads
        names = [*_paths(folders["sampler"]), *_missing(folders["sampler"]), *OTHER_PATHS]
        answers = {name: _create(c, prior={"type": "sampler", "name": name}) for name in names}
        for name, r in answers.items():
            assert r.status_code == 422, (name, r.status_code, r.text[:300])  # an existing folder is not loaded
            assert r.json()["error"]["message"].startswith("prior.name: expected a registered sampler name")
        assert len({(r.status_code, r.content) for r in answers.values()}) == 1, {n: r.text for n, r in answers.items()}


def test_an_operator_is_named_from_the_registry_only(server, folders):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        prior = {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}
        names = [*_paths(folders["operator"]), *_missing(folders["operator"]), *OTHER_PATHS]
        answers = {name: _create(c, prior=prior, method="mpf", operator=name) for name in names}
        for name, r in answers.items():
            assert r.status_code == 422, (name, r.status_code, r.text[:300])
            assert r.json()["error"]["message"].startswith("operator: expected a registered operator name")
        assert len({(r.status_code, r.content) for r in answers.values()}) == 1
        shipped = _create(c, prior=prior, method="mpf", operator=folders["operator"].name)
        assert shipped.status_code == 201, shipped.text  # the same operator by its registered name

"""The worked plugin example (``examples/plugin_family``) as a user runs it: installed next to mpflow (``pip install
--target``, offline), an operator trained for it with ``mpflow train --family poisson_counts``, and ``mpflow serve``
listing it in ``/v1/models`` and running streams of it — by ``smc`` and by ``mpf`` with that operator — while a
broken plugin installed beside it is left out, named in the server's log with what is wrong."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from tests.harness.server import serve_as_user
from tests.unit.test_family_plugins import install_fake

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "plugin_family"
PRIOR = {"type": "gaussian", "mean": [0.0, 0.5], "cov": [[1.0, 0.0], [0.0, 1.0]]}


def run(cmd: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_example_plugin_installs_trains_and_serves_beside_a_broken_one(tmp_path: Path) -> None:
    src, site, ops = tmp_path / "src", tmp_path / "site", tmp_path / "operators"
    shutil.copytree(EXAMPLE, src)  # pip builds in the source folder: keep the repository clean
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "--target", str(site)]
    run([*pip, str(src)], {**_base_env()}, tmp_path)
    install_fake(site)
    env = {**_base_env(), "PYTHONPATH": str(site)}
    train = ["train", "--family", "poisson_counts", "--dim", "2", "--iterations", "2", "--batch", "2"]
    train += ["--particles", "16", "--steps-per-seq", "2", "--out", str(ops)]
    run([sys.executable, "-m", "mpflow", *train], env, ROOT)
    assert (ops / "poisson_counts-d2-v1" / "weights.safetensors").is_file()

    server_env = {
        "PYTHONPATH": str(site),
        "MPFLOW_DATA_DIR": str(tmp_path / "data"),
        "MPFLOW_OPERATOR_DIRS": str(ops),
        "MPFLOW_WORKERS": "1",
        "MPFLOW_LOG_LEVEL": "INFO",  # the start-up line naming the plugins loaded
    }
    log = tmp_path / "server.log"
    with serve_as_user(server_env, log, start_timeout=90) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        listed = c.get("/v1/models").json()
        families = {f["family"]: f for f in listed["families"]}
        assert "poisson_counts" in families and "lds" in families
        assert {"smc", "mpf", "gpf"} <= set(families["poisson_counts"]["methods"])
        assert families["poisson_counts"]["parameters"][0]["name"] == "offset"
        assert "counts" in families  # the good plugin of the broken package is admitted
        assert "wrong_score" not in families and "no_likelihood" not in families
        for method in ("smc", "mpf"):
            body = {
                "model": {"family": "poisson_counts", "params": {"offset": 1.0}},
                "prior": PRIOR,
                "method": method,
                "num_particles": 64,
                "seed": 3,
            }
            r = c.post("/v1/streams", json=body)
            assert r.status_code == 201, r.text
            doc = r.json()
            if method == "mpf":  # a freshly trained operator serves only streams that name it (auto_select false)
                assert doc["operator"] is None and doc["untrained"], doc
                body["operator"] = "poisson_counts-d2-v1"
                r = c.post("/v1/streams", json=body)
                assert r.status_code == 201, r.text
                doc = r.json()
                assert doc["operator"] == "poisson_counts-d2-v1"
            r = c.post(f"/v1/streams/{doc['stream_id']}/observations", json={"observations": [[3, 1], [4, 0]]})
            assert r.status_code == 200, r.text
            assert r.json()["step"] == 2
            assert all(len(e["pit"]) == 2 and None not in e["pit"] for e in r.json()["per_step"])  # its p-values
            two_sided = [p for e in r.json()["per_step"] for p in e["pit_two_sided"]]  # what to threshold
            assert len(two_sided) == 4 and all(0.0 <= p <= 1.0 for p in two_sided), r.text
            r = c.post(f"/v1/streams/{doc['stream_id']}/observations", json={"observations": [[3, 2.5]]})
            assert r.status_code == 422 and "[1]: a count is a whole number ≥ 0, got 2.5" in r.text, r.text
    text = log.read_text()
    assert "model family plugins loaded: counts (fake_plugins:Counts), poisson_counts (mpflow_example_family:" in text
    assert "model family plugin 'wrong_score' (fake_plugins:WrongScore from fake-plugins 0.1): score gives" in text
    assert "model family plugin 'no_likelihood'" in text and "does not implement log_likelihood" in text
    # issue 58, item 6: a plugin without the optional methods is told what it loses; the example gives both
    assert "FamilyWarning: model family plugin 'counts'" in text and "observation_cdf — no predictive p-values" in text
    assert "FamilyWarning: model family plugin 'poisson_counts'" not in text


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("MPFLOW_") and k != "PYTHONPATH"}

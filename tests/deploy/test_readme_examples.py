"""The README's tour runs as written, against a server started as a user starts it.

The blocks under ``<!-- readme-test: NAME -->`` in README.md are run unchanged except for the port: the
server is ``python -m mpflow serve`` (what ``make serve`` runs) in a subprocess on a free port, with the embedded
Redis in a temporary data dir, so ``localhost:8000`` becomes ``localhost:<port>``. Bash blocks run under
``bash -e``, Python blocks with this interpreter. Each test checks what the README says the block prints,
against independent references where there are some: the conjugate posterior of ``linear_gaussian`` and the
Kalman filter of ``lds`` (:mod:`mpflow.operators.references`).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mpflow.operators.models import make_model
from mpflow.operators.references import kalman_filter
from mpflow.service.engine.default_methods import default_method
from mpflow.service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
OPERATIONS = ROOT / "docs" / "operations.md"
MARKER = re.compile(r"<!-- readme-test: (?P<name>[\w-]+) -->\s*\n```(?P<lang>\w+)\n(?P<code>.*?)\n```", re.S)
EXPECTED_BLOCKS = {"tour-curl": "bash", "tour-seq": "bash", "tour-python": "python", "cli": "bash", "ops-curl": "bash"}
#: blocks that need no server (they run the command line)
OFFLINE_BLOCKS = {"cli"}


def readme_blocks() -> dict[str, tuple[str, str]]:
    """``{name: (language, code)}`` of the marked blocks."""
    blocks: dict[str, tuple[str, str]] = {}
    for m in MARKER.finditer(README.read_text()):
        assert m["name"] not in blocks, f"README: two blocks are marked readme-test: {m['name']}"
        blocks[m["name"]] = (m["lang"], m["code"])
    return blocks


def run_block(name: str, port: int, python: str = sys.executable) -> str:
    """Run README block ``name`` with port 8000 replaced by ``port`` (a Python block with ``python``); its stdout."""
    lang, code = readme_blocks()[name]
    code = re.sub(r"\b(localhost|127\.0\.0\.1):8000\b", rf"\1:{port}", code)
    if lang == "bash":
        if shutil.which("curl") is None:
            pytest.skip("curl is not installed")
        cmd = ["bash", "-e", "-c", code]
    else:
        cmd = [python, "-c", code]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"README block {name} failed:\n{done.stderr[-2000:]}"
    return done.stdout


def _close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b, strict=True))


def test_readme_marks_the_tour_blocks() -> None:
    blocks = readme_blocks()
    assert {name: lang for name, (lang, _) in blocks.items()} == EXPECTED_BLOCKS
    for name, (_, code) in blocks.items():
        if name in OFFLINE_BLOCKS:
            continue
        assert re.search(r"(localhost|127\.0\.0\.1):8000", code), f"{name}: talks to the README's port 8000"


def test_curl_tour_as_written(server: int) -> None:
    """tour-curl: create (step 0, the measured default for linear_gaussian d = 2), two observations (the exact conjugate
    posterior N(0.2·Σo, 0.6 I), log-evidence −6.623), five samples; then tour-seq: a repeat is a duplicate,
    a gap is 409 ``seq_conflict``."""
    created, observed, sampled = (json.loads(line) for line in run_block("tour-curl", server).splitlines())
    assert created["step"] == 0 and created["stream_id"] == "demo"
    default = default_method("linear_gaussian", 2, True)
    assert created["method"] == default.method == "kalman" and created["method_reason"] == default.reason

    # exact posterior: prior N(0, I), o ~ N(x, 3I): precision 1 + 2/3, mean = 0.6 · Σo / 3
    obs = torch.tensor([[0.3, -1.2], [0.1, -0.9]], dtype=torch.float64)
    mean, var = (0.6 * obs.sum(0) / 3).tolist(), 0.6
    log_z = _joint_log_evidence(obs)
    summary = observed["summary"]
    assert observed["step"] == 2 and [s["step"] for s in observed["per_step"]] == [1, 2]
    sd = math.sqrt(var)
    assert _close(summary["mean"], mean, 0.05 * sd), (summary["mean"], mean)
    assert all(abs(summary["cov"][i][i] / var - 1) < 0.1 for i in range(2)), summary["cov"]
    assert abs(summary["log_evidence"] - log_z) < 0.1, (summary["log_evidence"], log_z)
    text = README.read_text().replace("−", "-")  # the README writes minus signs as U+2212
    quoted_mean = re.search(r"mean (?:≈ )?\[(-?\d+\.\d+), (-?\d+\.\d+)\]", text)
    quoted_log_z = re.search(r"log p\(o₁, o₂\) = (-?\d+\.\d+)", text)
    assert quoted_mean and quoted_log_z, "the README quotes the posterior mean and log-evidence of the tour"
    assert _close(mean, [float(quoted_mean[1]), float(quoted_mean[2])], 0.005), quoted_mean[0]
    assert abs(log_z - float(quoted_log_z[1])) < 0.0005, quoted_log_z[0]

    samples = sampled["samples"]
    assert len(samples) == 5 and all(len(s) == 2 and all(math.isfinite(v) for v in s) for s in samples)

    repeat, gap = run_block("tour-seq", server).splitlines()
    body, status = repeat.rsplit(" ", 1)
    doc = json.loads(body)
    assert status == "200" and doc["duplicate"] is True and doc["step"] == 2 and doc["per_step"] == []
    body, status = gap.rsplit(" ", 1)
    assert status == "409" and json.loads(body)["error"]["code"] == "seq_conflict"


def _joint_log_evidence(obs: torch.Tensor) -> float:
    """log p(o_1, o_2) for x ~ N(0, I), o_m | x ~ N(x, 3I): per coordinate, (o_1, o_2) ~ N(0, 3I + 11ᵀ)."""
    cov = 3 * torch.eye(len(obs), dtype=torch.float64) + torch.ones(len(obs), len(obs), dtype=torch.float64)
    law = torch.distributions.MultivariateNormal(torch.zeros(len(obs), dtype=torch.float64), cov)
    return float(law.log_prob(obs.T).sum())


def quoted_tour_lines() -> list[list[float]]:
    """The lines the README says tour-python prints, e.g. `1 [0.18, -0.77] -3.17`, as [mean₁, mean₂, increment]."""
    quoted = [
        [float(v) for v in m]
        for m in re.findall(r"`\d \[(-?\d+\.\d+), (-?\d+\.\d+)\] (-?\d+\.\d+)`", README.read_text())
    ]
    assert len(quoted) == 3, quoted
    return quoted


def tour_line(line: str) -> tuple[int, list[float], float]:
    """One printed line of tour-python: (step, posterior mean, log-evidence increment)."""
    m = re.fullmatch(r"(\d+) \[(\S+), (\S+)\] (\S+)", line)
    assert m, line
    return int(m[1]), [float(m[2]), float(m[3])], float(m[4])


def test_python_tour_as_written(server: int) -> None:
    """tour-python: one line per step, ``step [mean] log_evidence_increment``, next to the exact Kalman filter."""
    lines = run_block("tour-python", server).splitlines()
    model = make_model("lds", {"A": [[0.9, 0.1], [0, 0.9]], "B": [[1, 0], [0, 1]]}, state_dim=2, dtype=torch.float64)
    obs = torch.tensor([[[0.3, -1.2], [0.1, -0.9], [0.4, -0.2]]], dtype=torch.float64)
    means, covs, increments = kalman_filter(
        torch.zeros(1, 2, dtype=torch.float64), torch.eye(2, dtype=torch.float64)[None], model, obs
    )
    assert len(lines) == 3, lines
    quoted = quoted_tour_lines()
    for t, line in enumerate(lines):
        step, mean, inc = tour_line(line)
        assert step == t + 1
        sd = covs[0, t].diagonal().sqrt().tolist()
        assert all(abs(a - b) <= 0.05 * s for a, b, s in zip(mean, means[0, t].tolist(), sd, strict=True)), line
        assert abs(inc - float(increments[0, t])) < 0.1, (line, float(increments[0, t]))
        assert _close([*mean, inc], quoted[t], 0.005), f"README quotes {quoted[t]}, the service printed {line}"


def test_command_line_block_as_written() -> None:
    """cli: ``mpflow info`` (readable: families, operators, settings), ``mpflow filter --method mpf`` (naming the
    operator it runs, then a table against the exact posterior), ``mpflow --help`` (every command)."""
    lang, code = readme_blocks()["cli"]
    done = subprocess.run(["bash", "-e", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    for heading in ("Model families", "Trained operators", "Service settings in force"):
        assert heading in out
    assert "# mpf with the operator lds-d2-v1 (the newest for lds, d = 2)" in out
    assert "log-evidence error vs Kalman" in out
    assert all(command in out for command in ("info", "filter", "train", "evaluate", "fit-sampler", "serve"))


def test_operations_block_as_written(server: int) -> None:
    """ops-curl: /healthz and /readyz bodies, and the two always-present metrics."""
    health, ready, *metrics = run_block("ops-curl", server).splitlines()
    assert json.loads(health) == {"status": "ok"}
    assert json.loads(ready) == {"status": "ready", "store": True, "operators": True}
    values = dict(line.split(" ") for line in metrics)
    assert set(values) == {"mpflow_streams", "mpflow_store_errors_total"}
    assert float(values["mpflow_store_errors_total"]) == 0.0 and float(values["mpflow_streams"]) >= 0


def test_configuration_table_lists_every_setting() -> None:
    """The settings table (docs/operations.md, where the README links for configuration) names every setting with
    its default."""
    text = OPERATIONS.read_text()
    section = text[text.index("## Configuration") : text.index("\n## ", text.index("## Configuration") + 1)]
    rows = dict(re.findall(r"^\| `(MPFLOW_[A-Z_]+)` \| ([^|]+) \|", section, re.M))
    documented = set(rows)
    settings = {f"MPFLOW_{name.upper()}" for name in Settings.model_fields}
    assert settings <= documented, f"settings missing from the table: {sorted(settings - documented)}"
    assert documented - settings <= {"MPFLOW_HOST", "MPFLOW_PORT", "MPFLOW_WORKERS"}
    for name, field in Settings.model_fields.items():
        default = field.default
        if isinstance(default, bool | int | float) and not isinstance(default, bool):
            assert f"`{default}`" in rows[f"MPFLOW_{name.upper()}"], f"MPFLOW_{name.upper()}: default {default}"

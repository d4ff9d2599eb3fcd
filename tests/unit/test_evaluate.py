"""The evaluation report (training/evaluate.py): quick runs on untrained operators (zero residual = the exact
Daum–Huang flow), whose accuracy against the exact Kalman posterior is known, so the reference and metric
wiring is checked, not only the file layout."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from mpflow.operators.models import FAMILIES
from mpflow.operators.mpf.network import MPFVelocity
from mpflow.operators.registry import load_record, save_operator
from mpflow.training import evaluate as ev

ARCH = {"hidden": 8, "layers": 2, "embed": 8, "use_base": True}


def untrained_operator(root, family: str, d: int, obs_dim: int):
    """An operator folder whose network has a zero residual (MPFVelocity's last layer starts at zero)."""
    torch.manual_seed(0)
    net = MPFVelocity(d, **ARCH)
    config = {
        "family": family,
        "state_dim": d,
        "obs_dim": obs_dim,
        "architecture": ARCH,
        "training": {"iterations": 0, "task_kwargs": {}},
        "solver": {"method": "rk4", "steps": 1},
    }
    return save_operator(root, None, config, net.state_dict(), {"val_loss_best": 1.0}, "untrained (test)\n")


def is_png(path) -> bool:
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def lg_run(tmp_path_factory):
    """`mpflow evaluate --quick --write-registry` on an untrained linear_gaussian d = 2 operator, via add_parser."""
    root = tmp_path_factory.mktemp("ops")
    record = untrained_operator(root, "linear_gaussian", 2, 2)
    out = tmp_path_factory.mktemp("eval")
    parser = argparse.ArgumentParser(prog="mpflow")
    ev.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        [
            "evaluate",
            "--operator",
            str(record.path),
            "--quick",
            "--out",
            str(out),
            "--particles",
            "64",
            "--steps",
            "6",
            "--quiet",
            "--write-registry",
        ]
    )
    assert args.func(args) == 0
    return record, out, json.loads((out / "metrics.json").read_text())


def test_quick_report_files_and_keys(lg_run, capsys):
    record, out, m = lg_run
    assert m["operator"]["name"] == record.name
    assert m["operator"]["content_hash"] == record.content_hash
    s = m["settings"]
    assert (s["quick"], s["tasks"], s["steps"], s["particles"], s["seed"]) == (True, 2, 6, [64], ev.EVAL_SEED)
    assert m["reference"]["kind"] == "kalman" and len(m["reference"]["entropy_curve"]) == 6
    methods = [(r["method"], r["particles"]) for r in m["results"]]
    assert methods == [("mpf", 64), ("mpf-base", 64), ("smc", 64), ("gpf", 64)]
    for r in m["results"]:
        assert "error" not in r
        for name in ev.METRICS:
            assert math.isfinite(r["summary"][name]["avg"])
            assert len(r["curves"][name]) == 6 and len(r["curves"][f"{name}_sem"]) == 6
        assert list(r["summary"]["var_ratio"]["at"]) == ["6"]  # no step 10/50/100 within 6: only the final one
        assert r["summary"]["mmd2"]["sem_final"] > 0
        assert len(r["curves"]["var_ratio_per_dim"][0]) == 2
        assert r["summary"]["ms_per_update"] > 0
    assert m["wall_s"] > 0
    assert m["plots"] == ["errors.png", "posterior_evolution.png"]
    for name in m["plots"]:
        assert is_png(out / name)


def test_exact_daum_huang_matches_kalman_and_beats_smc(lg_run):
    """The untrained operator is the exact Daum–Huang filter: ≈ 0 error against Kalman (tolerance 0.1 sd,
    variance within 5%, log-evidence increments within 0.05 nats); SMC with 64 particles is visibly worse."""
    _, _, m = lg_run
    res = {r["method"]: r["summary"] for r in m["results"]}
    assert res["mpf"]["mean_error_sd"]["avg"] < 0.1
    assert all(
        abs(v - 1) < 0.05
        for row in next(r for r in m["results"] if r["method"] == "mpf")["curves"]["var_ratio_per_dim"]
        for v in row
    )
    assert res["mpf"]["logz_increment_error"]["avg"] < 0.05
    assert res["smc"]["mean_error_sd"]["avg"] > res["mpf"]["mean_error_sd"]["avg"]
    assert res["smc"]["mmd2"]["avg"] > res["mpf"]["mmd2"]["avg"]
    # cross-entropy is bounded below by the exact posterior's entropy (up to the KDE's Monte-Carlo noise)
    floor = sum(m["reference"]["entropy_curve"]) / 6
    assert res["mpf"]["cross_entropy"]["avg"] > floor - 0.05


def test_table_and_registry_merge(lg_run, capsys):
    record, _, m = lg_run
    table = ev.format_table(m)
    assert table.splitlines()[0].split()[:3] == ["method", "N", "mean"] and "kalman" in table
    assert "MMD²@6" in table.splitlines()[0]  # the final step's MMD² (gmm: "after 30 observations")
    after = load_record(record.path)
    assert after.content_hash == record.content_hash  # metrics.json is outside the hash
    evaluation = after.metrics["evaluation"]
    assert after.metrics["val_loss_best"] == 1.0  # merged, not replaced
    assert [r["method"] for r in evaluation["results"]] == ["mpf", "mpf-base", "smc", "gpf"]
    assert "curves" not in evaluation["results"][0]


def test_kalman_reference_samples_have_the_exact_moments(tmp_path):
    record = untrained_operator(tmp_path, "linear_gaussian", 2, 2)
    tasks = ev.held_out_tasks(record, 2, 3)
    ref = ev.kalman_reference(tasks, 4000, ev.EVAL_SEED)
    z = (ref.samples.mean(2) - ref.means) / torch.diagonal(ref.covs, dim1=-2, dim2=-1).sqrt()
    assert float(z.abs().max()) < 4.5 / math.sqrt(4000)  # 4.5 standard errors


def test_mode_fractions():
    modes = ev.gmm_modes(torch.tensor([[1.0, -2.0]]))
    assert torch.equal(modes, torch.tensor([[[1.0, -2.0], [-1.0, 2.0]]], dtype=torch.float64))
    x = torch.tensor([[[0.9, -1.5], [1.2, -2.5], [-1.0, 1.0], [0.1, -0.1]]])
    assert ev.mode_fractions(x, None, modes).tolist() == [[0.75, 0.25]]
    lw = torch.log(torch.tensor([[0.1, 0.1, 0.7, 0.1]]))
    assert torch.allclose(ev.mode_fractions(x, lw, modes), torch.tensor([[0.3, 0.7]], dtype=torch.float64))


def test_quick_gmm_posterior_evolution(tmp_path):
    record = untrained_operator(tmp_path / "ops", "gmm", 2, 1)
    out = tmp_path / "eval"
    m = ev.evaluate(record, quick=True, out=out, particles=[64], steps=5, methods=("mpf", "smc"), progress=False)
    assert m["reference"]["kind"] == "importance" and m["reference"]["particles"] == ev.REF_PARTICLES_QUICK
    assert m["reference"]["ess_min"] > ev.REF_SAMPLES_QUICK
    for curve in [m["reference"]["mode_fraction_curve"], *(r["curves"]["mode_fraction"] for r in m["results"])]:
        assert len(curve) == 5
        assert all(abs(sum(row) - 1) < 1e-9 and min(row) >= 0 for row in curve)
    assert set(m["plots"]) == {"errors.png", "modes.png", "posterior_evolution.png"}
    assert all(is_png(out / p) for p in m["plots"])
    assert json.loads((out / "metrics.json").read_text())["results"][0]["summary"]["mode_fraction_final"]


def test_bad_arguments(tmp_path):
    record = untrained_operator(tmp_path, "linear_gaussian", 2, 2)
    with pytest.raises(ValueError, match=r"^methods:"):
        ev.evaluate(record, quick=True, methods=("nope",), progress=False)
    with pytest.raises(ValueError, match=r"^particles:"):
        ev.evaluate(record, quick=True, particles=[0], progress=False)
    with pytest.raises(ValueError, match=r"^operator:"):
        ev.evaluate("no-such-operator-v1", quick=True, progress=False)


def test_mpf_base_is_the_operators_own_base_flow(tmp_path):
    """ "mpf-base" runs the operator's architecture with a zero residual: an importance-linearised operator's
    base is the importance-fitted Daum–Huang flow, not the default (Stein) one."""
    torch.manual_seed(0)
    arch = {**ARCH, "linearisation": "importance"}
    config = {
        "family": "gmm",
        "state_dim": 2,
        "obs_dim": 1,
        "architecture": arch,
        "training": {"iterations": 0, "task_kwargs": {}},
        "solver": {"method": "rk4", "steps": 1},
    }
    record = save_operator(tmp_path, None, config, MPFVelocity(2, **arch).state_dict(), {}, "untrained (test)\n")
    base = ev.method_updater("mpf-base", record).network(2)
    assert base.linearisation == "importance"
    assert all(float(p.detach().abs().max()) == 0.0 for p in base.layers[-1].linear.parameters())
    assert ev.method_updater("mpf-base", untrained_operator(tmp_path, "gmm", 2, 1)).network(2).linearisation == "stein"


def test_defaults_come_from_the_families():
    """The paper's sequence lengths (MPF §5) and particle counts, read off the family classes."""
    paper = {"linear_gaussian": 100, "lds": 25, "gmm": 30, "logistic": 20, "stochastic_volatility": 50}
    assert {k: ev.DEFAULT_STEPS[k] for k in paper} == paper
    assert ev.DEFAULT_STEPS.keys() == FAMILIES.keys()  # every family, the paper's and the others, says its own
    assert ev.DEFAULT_PARTICLES["lds"] == (64, 256, 1024) and ev.DEFAULT_PARTICLES["gmm"] == (256,)


def test_plots_do_not_import_the_evaluation():
    """evaluate → eval_plots → eval_types, and no cycle back: the plots read the shared data types only."""
    import ast
    from pathlib import Path

    from mpflow.training import eval_plots, eval_types

    for module, forbidden in ((eval_plots, "mpflow.training.evaluate"), (eval_types, "mpflow.training.eval")):
        tree = ast.parse(Path(module.__file__).read_text())
        imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in imported if m and m.startswith(forbidden)], module.__name__
    assert ev.Reference is eval_types.Reference and ev.MethodRun is eval_types.MethodRun

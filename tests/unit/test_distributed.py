"""Data-parallel meta-training (torchrun / DistributedDataParallel) on CPU with the gloo backend and 2
processes: both ranks end with the same θ (gradients are all-reduced), that θ differs from a one-process
run on rank 0's tasks alone (so rank 1's gradients were used), and ``torchrun … mpflow train`` writes one
operator that records its world size."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from mpflow.operators.mpf.network import MPFVelocity
from mpflow.training.meta_train import meta_train

KW = dict(iterations=2, batch=2, T=2, N=16, val_every=1, val_tasks=2, lr=1e-2, progress=False, device="cpu")


def _net() -> MPFVelocity:
    torch.manual_seed(0)
    return MPFVelocity(2, hidden=16, layers=2, embed=8)


def _worker(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = meta_train(_net(), "gmm", 2, **KW)
        torch.save(result["final_state"], Path(out) / f"rank{rank}.pt")  # the last iterate (rank 0 also keeps the best)
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_average_their_gradients(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    alone = meta_train(_net(), "gmm", 2, **KW)["final_state"]
    assert all(torch.equal(r0[k], r1[k]) for k in r0)
    assert any(not torch.allclose(r0[k], alone[k]) for k in r0)


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None, reason="no torchrun")
def test_torchrun_cli_trains_one_operator(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    cmd = [
        torchrun,
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "mpflow",
        "train",
        "--family",
        "linear_gaussian",
    ]
    cmd += ["--dim", "2", "--iterations", "2", "--batch", "2", "--steps-per-seq", "2", "--particles", "16"]
    cmd += ["--val-every", "1", "--val-tasks", "2", "--hidden", "8", "--embed", "8", "--out", str(tmp_path), "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    folders = [p for p in tmp_path.iterdir() if not p.name.startswith("_")]
    assert [p.name for p in folders] == ["linear_gaussian-d2-v1"]
    config = json.loads((folders[0] / "config.json").read_text())
    assert config["training"]["world_size"] == 2
    # the README's command reproduces the run: torchrun with the same process count (the global batch)
    assert (
        "torchrun --standalone --nproc_per_node 2 -m mpflow train --family linear_gaussian"
        in (folders[0] / "README.md").read_text()
    )

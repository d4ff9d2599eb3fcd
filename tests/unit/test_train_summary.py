"""``mpflow train`` says what it did (issue 38, item 3): the closing summary (iterations, wall time, why it
stopped, validation before → best, the benchmark verdict), the progress bar's total under ``--max-minutes``, and
an operator it saves is never picked automatically (``auto_select`` false: nothing compared it with its base flow
at equal compute)."""

from __future__ import annotations

import json

from mpflow.operators.registry import resolve
from mpflow.training.meta_train import projected_total, stop_reason

from mpflow.cli.main import main


def test_the_bar_counts_down_to_the_time_limit_not_to_the_iterations():
    # 79 iterations in 60 s of a 2-minute cap: about 79 more fit, not 2000
    assert projected_total(2000, 79, 0, 60.0, 2.0) == 158
    assert projected_total(2000, 79, 0, 60.0, None) == 2000  # no cap: all of them
    assert projected_total(100, 79, 0, 60.0, 2.0) == 100  # the cap allows more than asked
    assert projected_total(2000, 79, 0, 130.0, 2.0) == 79  # past the cap: the bar ends where it is
    assert projected_total(2000, 60, 50, 10.0, 1.0) == 60 + 50  # a resumed run: its own pace (10 it in 10 s)


def test_stop_reason_says_why():
    assert stop_reason(79, 2000, True, 2.0) == "the time limit (--max-minutes 2) after 79 of 2000 iterations"
    assert stop_reason(5, 5, False, None) == "all 5 iterations done"


def test_train_ends_with_a_summary_and_saves_a_named_only_operator(tmp_path, capsys):
    argv = ["train", "--family", "gmm", "--dim", "2", "--iterations", "3", "--batch", "2", "--steps-per-seq", "2"]
    argv += ["--particles", "16", "--out", str(tmp_path), "--val-every", "1", "--val-tasks", "2", "--quiet"]
    assert main([*argv, "--max-minutes", "0.0001"]) == 0
    captured = capsys.readouterr()
    saved = json.loads(captured.out.strip().splitlines()[-1])["saved"]
    summary = captured.err[captured.err.index("mpflow train: ") :].splitlines()
    assert summary[0].startswith("mpflow train: 1 iterations in ") and summary[0].endswith(
        "stopped: the time limit (--max-minutes 0.0001) after 1 of 3 iterations"
    )
    assert summary[1].startswith("  validation loss: ") and " untrained → " in summary[1]
    assert "best, at iteration" in summary[1]
    assert summary[2] == f"  saved: {saved} (auto_select: false — it serves only a stream that names it)"
    assert summary[3].startswith(f"  benchmark: not run; mpflow evaluate --operator {saved}")
    record = resolve(saved)
    assert record.auto_select is False and "equal compute" in record.auto_select_note
    assert record.to_json()["auto_select"] is False

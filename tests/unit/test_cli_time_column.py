"""``mpflow filter --data … --time-column`` (mpflow.cli.filter_data): a column of timestamps — dates and times or
numbers of seconds — gives each step's ``dt`` (their differences in ``--time-unit``, the first step's the median
difference), exactly as a ``dt`` column of those values would; bad times are refused naming the row; and the output
has the log tails, the surprise and the anomaly score (ranked in-process as a server ranks them)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re

import numpy as np
import pytest

from mpflow.cli.filter_data import time_steps
from mpflow.cli.main import main

pd = pytest.importorskip("pandas")

#: dx = −0.5 x dt + dW, o = x + N(0, 1): its steps depend on dt
BODY = {
    "model": {"family": "lds", "params": {"F": [[-0.5]], "B": [[1.0]]}},
    "prior": {"type": "gaussian", "mean": [0.0], "cov": [[1.0]]},
    "method": "kalman",
    "anomaly_warmup": 2,
}
TIMES = ["2024-01-01 00:00:00", "2024-01-01 00:05:00", "2024-01-01 00:15:00", "2024-01-01 00:20:00",
         "2024-01-01 01:20:00"]  # fmt: skip
VALUES = [0.5, 1.0, -0.3, 0.2, 6.0]
#: in minutes: 5, 10, 5, 60 apart; the first step the median, 7.5
DTS = [7.5, 5.0, 10.0, 5.0, 60.0]


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["filter", "--quiet", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.json"
    path.write_text(json.dumps(BODY))
    return path


def test_time_steps_of_dates_and_of_numbers():
    frame = pd.DataFrame({"t": TIMES})
    assert time_steps(frame, "t", "min") == DTS
    assert time_steps(frame, "t") == [60 * d for d in DTS]
    assert time_steps(pd.DataFrame({"t": ["2024-01-01T00:00:00Z", "2024-01-01T02:00:00+01:00"]}), "t", "h") == [
        1.0,
        1.0,
    ]
    assert time_steps(pd.DataFrame({"t": [100.0, 101.0, 103.0, 104.0]}), "t") == [1.0, 1.0, 2.0, 1.0]
    assert time_steps(pd.DataFrame({"t": [5]}), "t") == []  # one row: no dt


def test_a_time_column_gives_the_steps_a_dt_column_would(tmp_path, model_file, capsys):
    timed, plain = tmp_path / "timed.csv", tmp_path / "plain.csv"
    timed.write_text("timestamp,y\n" + "".join(f"{t},{y}\n" for t, y in zip(TIMES, VALUES, strict=True)))
    plain.write_text("y,dt\n" + "".join(f"{y},{d}\n" for y, d in zip(VALUES, DTS, strict=True)))
    args = ["--model", str(model_file), "--time-column", "timestamp", "--time-unit", "min"]
    code, out, err = _run(capsys, "--data", str(timed), *args)
    assert code == 0, err
    frame = pd.read_csv(io.StringIO(out), index_col="step")
    code, out, err = _run(capsys, "--data", str(plain), "--model", str(model_file))
    assert code == 0, err
    reference = pd.read_csv(io.StringIO(out), index_col="step")
    np.testing.assert_allclose(frame["mean_x0"], reference["mean_x0"], rtol=1e-12)
    assert "timestamp" not in " ".join(frame.columns)  # not an observation column
    # by hand: a = e^{−0.5 dt}, q = 1 − a², R = 1
    m, p, means = 0.0, 1.0, []
    for y, dt in zip(VALUES, DTS, strict=True):
        a = math.exp(-0.5 * dt)
        m, p = a * m, a * a * p + (1 - a * a)
        k = p / (p + 1.0)
        m, p = m + k * (y - m), (1 - k) * p
        means.append(m)
    np.testing.assert_allclose(frame["mean_x0"], means, atol=1e-6)
    # the new columns: log tails per entry, the surprise, and the score after the 2-step warm-up
    assert {"log_tail_lower_0", "log_tail_upper_0", "surprise", "anomaly_score"} <= set(frame.columns)
    np.testing.assert_allclose(np.exp(frame["log_tail_lower_0"]), frame["pit_0"], rtol=1e-6)
    assert frame["anomaly_score"].iloc[:2].isna().all() and frame["anomaly_score"].iloc[2:].notna().all()
    assert frame["anomaly_score"].iloc[-1] == 1.0 and frame["surprise"].iloc[-1] > 5  # 6 sd: the top so far


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("t,y\n1,0.5\n1,0.2\n", [], r"--time-column: row 2, column 't': its time is not after the previous row's"),
        ("t,y\n2024-01-01,0.5\nsoon,0.2\n", [], r"--time-column: row 2, column 't': 'soon' is not a time"),
        ("t,y\n1,0.5\n,0.2\n", [], r"--time-column: row 2, column 't': empty"),
        ("t,y,dt\n1,0.5,1\n2,0.2,1\n", [], r"--time-column: the data file has a 'dt' column too"),
        ("y\n0.5\n", [], r"--time-column: no column 't'"),
        ("t,y\n1,0.5\n2,0.2\n", ["--time-unit", "fortnight"], r"--time-unit"),
    ],
)
def test_bad_times_are_refused_naming_the_row(tmp_path, model_file, capsys, content, extra, message):
    data = tmp_path / "bad.csv"
    data.write_text(content)
    with pytest.raises(SystemExit) if "fortnight" in extra else contextlib.nullcontext():  # argparse's choices
        code, _, err = _run(capsys, "--data", str(data), "--model", str(model_file), "--time-column", "t", *extra)
        assert code == 2
        assert re.search(message, err), err
    if "fortnight" in extra:
        assert re.search(message, capsys.readouterr().err)

"""``mpflow filter --data FILE --model model.json`` in-process (mpflow.cli.filter_data): CSV and Parquet files,
missing values, dt and input columns, and the refusals of bad files and bad model files. The estimates are
checked against a Kalman filter written here in numpy (independent of the service's code)."""

from __future__ import annotations

import io
import json
import math
import re

import numpy as np
import pytest

from mpflow.cli.filter_data import MAX_COLUMNS, read_table
from mpflow.cli.main import main

pd = pytest.importorskip("pandas")

A, Q, R = 0.9, 1.0, 0.5
MODEL = {
    "model": {"family": "lds", "params": {"A": [[A]], "B": [[1.0]], "Q": [[Q]], "R": [[R]]}},
    "prior": {"type": "gaussian", "mean": [0.0], "cov": [[1.0]]},
    "method": "kalman",
    "seed": 3,
}
VALUES = [0.5, math.nan, 1.2, 0.3, -0.4, 2.0]


def numpy_kalman(values: list[float], dts: list[float] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(means, sds, log-evidence increments) of the 1-D model x' = A x + N(0, Q), y = x + N(0, R); NaN: no
    measurement (predict only, no score: increment NaN)."""
    m, p, means, sds, incs = 0.0, 1.0, [], [], []
    for y in values:
        m, p = A * m, A * A * p + Q
        inc = math.nan
        if not math.isnan(y):
            s = p + R
            inc = -0.5 * (math.log(2 * math.pi * s) + (y - m) ** 2 / s)
            k = p / s
            m, p = m + k * (y - m), (1 - k) * p
        means.append(m)
        sds.append(math.sqrt(p))
        incs.append(inc)
    return np.array(means), np.array(sds), np.array(incs)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.json"
    path.write_text(json.dumps(MODEL))
    return path


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["filter", "--quiet", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _check_kalman(frame, values):
    means, sds, incs = numpy_kalman(values)
    assert list(frame.index) == list(range(1, len(values) + 1))
    np.testing.assert_allclose(frame["mean_x0"], means, atol=1e-6)
    np.testing.assert_allclose(frame["std_x0"], sds, atol=1e-6)
    np.testing.assert_allclose(frame["log_evidence_increment"], incs, atol=1e-6)
    np.testing.assert_allclose(frame["q0.05_x0"], means - 1.6448536 * sds, atol=1e-5)
    np.testing.assert_allclose(frame["q0.95_x0"], means + 1.6448536 * sds, atol=1e-5)
    # p-values named by the observation's entry, not by a state dimension (was pit_x0 here)
    assert {"pit_0", "pit_two_sided_0"} <= set(frame.columns) and "pit_x0" not in frame.columns
    assert np.isnan(frame["pit_0"].iloc[1])  # nothing observed
    # the 95 % band --plot draws
    np.testing.assert_allclose(frame["q0.025_x0"], means - 1.9599640 * sds, atol=1e-5)
    np.testing.assert_allclose(frame["q0.975_x0"], means + 1.9599640 * sds, atol=1e-5)


def test_a_csv_with_missing_values_gives_the_kalman_estimates(tmp_path, model_file, capsys):
    data = tmp_path / "readings.csv"
    data.write_text("y\n" + "\n".join("" if math.isnan(v) else str(v) for v in VALUES) + "\n")
    out, png = tmp_path / "estimates.csv", tmp_path / "estimates.png"
    code, _, err = _run(capsys, "--data", str(data), "--model", str(model_file), "--out", str(out), "--plot", str(png))
    assert code == 0, err
    _check_kalman(pd.read_csv(out, index_col="step"), VALUES)
    assert png.stat().st_size > 10_000  # a real figure was drawn


def test_a_parquet_file_in_and_out_with_columns_by_name(tmp_path, model_file, capsys):
    data = tmp_path / "readings.parquet"
    pd.DataFrame({"note": np.arange(len(VALUES)) * 10.0, "y": VALUES}).to_parquet(data)
    out = tmp_path / "estimates.parquet"
    args = ["--data", str(data), "--model", str(model_file), "--columns", "y", "--out", str(out)]
    code, _, err = _run(capsys, *args)
    assert code == 0, err
    _check_kalman(pd.read_parquet(out), VALUES)


def test_stdout_csv_a_dt_column_and_input_columns(tmp_path, capsys):
    """A continuous-time model (dx = (F x + C u) dt + dW) with dt per row and a control input: the file's dt and u
    reach each step."""
    body = {
        "model": {"family": "lds", "params": {"F": [[-0.5]], "C": [[1.0]], "B": [[1.0]]}},
        "prior": {"type": "gaussian", "mean": [0.0], "cov": [[1.0]]},
        "method": "kalman",
    }
    (tmp_path / "m.json").write_text(json.dumps(body))
    data = tmp_path / "r.csv"
    rows = [(0.5, 0.5, 1.0), (math.nan, 2.0, 0.0), (1.5, 0.25, -1.0)]
    data.write_text("y,dt,u\n" + "".join(f"{'' if math.isnan(y) else y},{dt},{u}\n" for y, dt, u in rows))
    code, out, err = _run(capsys, "--data", str(data), "--model", str(tmp_path / "m.json"), "--inputs", "u")
    assert code == 0, err
    frame = pd.read_csv(io.StringIO(out), index_col="step")
    # exact discretisation over dt: a = e^{-0.5 dt}, input gain (1 - a) / 0.5, q = (1 - a^2) / (2 * 0.5); R = 1
    m, p, means = 0.0, 1.0, []
    for y, dt, u in rows:
        a = math.exp(-0.5 * dt)
        m, p = a * m + (1 - a) / 0.5 * u, a * a * p + (1 - a * a)
        if not math.isnan(y):
            k = p / (p + 1.0)
            m, p = m + k * (y - m), (1 - k) * p
        means.append(m)
    np.testing.assert_allclose(frame["mean_x0"], means, atol=1e-6)


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("y\n0.5\nabc\n", [], r"row 2, column 'y': 'abc' is not a number"),
        ("y\n0.5\n1.0\n", ["--columns", "z"], r"--columns: no column 'z' in the data file \(its columns: \['y'\]\)"),
        ("y,dt\n0.5,1\n1.0,\n", [], r"row 2, column 'dt': empty"),
        ("y\n0.5\ninf\n", [], r"row 2, column 'y': infinite"),
        ("y,z\n0.5,1\n", [], r"row 1: expected shape \[1\], got \[2\] \(the observation columns: \['y', 'z'\]"),
    ],
)
def test_bad_files_are_refused_naming_the_row_and_column(tmp_path, model_file, capsys, content, extra, message):
    data = tmp_path / "bad.csv"
    data.write_text(content)
    code, _, err = _run(capsys, "--data", str(data), "--model", str(model_file), *extra)
    assert code == 2
    assert re.search(message, err), err


def test_bad_model_files_are_refused_naming_the_field(tmp_path, capsys):
    data = tmp_path / "r.csv"
    data.write_text("y\n0.5\n")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**MODEL, "method": "no-such-method"}))
    code, _, err = _run(capsys, "--data", str(data), "--model", str(bad))
    assert code == 2 and "method" in err and str(bad) in err
    bad.write_text("{not json")
    code, _, err = _run(capsys, "--data", str(data), "--model", str(bad))
    assert code == 2 and "is not valid JSON" in err
    code, _, err = _run(capsys, "--data", str(data))
    assert code == 2 and "--model" in err


def test_the_file_limits_are_enforced(tmp_path):
    wide = tmp_path / "wide.csv"
    wide.write_text(",".join(f"c{i}" for i in range(MAX_COLUMNS + 1)) + "\n" + ",".join(["1"] * (MAX_COLUMNS + 1)))
    with pytest.raises(ValueError, match=f"at most {MAX_COLUMNS} columns"):
        read_table(str(wide))
    wide_parquet = tmp_path / "wide.parquet"
    pd.DataFrame({f"c{i}": [1.0] for i in range(MAX_COLUMNS + 1)}).to_parquet(wide_parquet)
    with pytest.raises(
        ValueError, match=f"{MAX_COLUMNS} columns per file, .* has 1 rows and {MAX_COLUMNS + 1} columns"
    ):
        read_table(str(wide_parquet))
    with pytest.raises(ValueError, match="no such file"):
        read_table(str(tmp_path / "absent.csv"))
